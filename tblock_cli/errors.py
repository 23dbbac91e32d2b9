"""The one exception family that carries a user's mistake to the CLI edge as an exit code."""

import contextlib
import os

# The process's own exit, kept before anything can replace it: `interrupted` and forked children end through it.
_REAL_EXIT = os._exit


class TBlockError(Exception):
    """A problem the user can fix; `cli.py` prints its message on one line and exits `exit_code`."""

    exit_code = 2


class ConfigError(TBlockError):
    """A flag value that cannot build or run a block (bad size, unknown dtype, missing device)."""


class NotAReport(ConfigError, TypeError):
    """The API was handed something other than a report (assert_ok(None)): a ConfigError, and a TypeError as Python has it."""


class ResourceError(TBlockError):
    """The requested sizes would not fit in the memory the device has free."""


class LoadError(TBlockError):
    """A --block SPEC that cannot be imported, built or called."""


class MeasureError(TBlockError):
    """The block raised while being measured (bench, depth, params of a user block): a failure, exit 1."""

    exit_code = 1


class BlockExited(MeasureError):
    """The user's code called os._exit() while tblock ran it: reported as a failure instead of ending tblock."""


@contextlib.contextmanager
def exits_guarded():
    """os._exit raises BlockExited for a while in this process (a block calling it in its forward or at import would
    otherwise end tblock with its code, 0 included, and nothing printed; no atexit hook runs on os._exit). A forked
    child (a rank, a compile worker) still ends through the real one."""
    pid = os.getpid()

    def guarded(code=0):
        if os.getpid() != pid:
            _REAL_EXIT(code)
        raise BlockExited(f"the block called os._exit({code}), which would have ended tblock; a block must return")

    os._exit = guarded
    try:
        yield
    finally:
        os._exit = _REAL_EXIT


# What a user's block may raise that tblock reports instead of dying: any Exception, and SystemExit (a block
# calling sys.exit() would otherwise end tblock with the block's exit code and nothing printed).
USER_ERRORS = (Exception, SystemExit)

OOM_HINT = "reduce --batch, --seq, --d-model or --layers"


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA's 'out of memory', the CPU allocator's "can't allocate memory", or Python's MemoryError."""
    if isinstance(e, MemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def reraise_as_measure_error(e: BaseException, what: str) -> None:
    """Turn an exception from the user's block into a MeasureError; out-of-memory passes through."""
    if isinstance(e, TBlockError) or is_out_of_memory(e):
        raise e
    raise MeasureError(f"{what}: {one_line(e)}") from e


# Where "interrupted" goes: fd 2, or the saved real stderr while fd 2 points at /dev/null (the profiler's quiet window).
STDERR_FD = [2]


def interrupted(*_) -> None:
    """SIGINT: one line and exit 130, whatever the program was doing (importing, tracing, inside a library that
    catches KeyboardInterrupt): unwinding from an arbitrary point was seen to end in RecursionError, in
    ImportError on a half-imported module, or to be swallowed."""
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.write(STDERR_FD[0], b"interrupted\n")
    finally:
        _REAL_EXIT(130)


def on_interrupt() -> None:
    """Make SIGINT end the command through `interrupted` (unless someone installed their own handler)."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)
