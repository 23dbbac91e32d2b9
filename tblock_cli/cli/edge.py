"""The edge of every command: consoles, warnings and errors as one line, --json owning stdout, the exit code."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

import typer

from tblock_cli.errors import OOM_HINT, ConfigError, TBlockError
from tblock_cli.render.common import make_console
from tblock_cli.report import ensure_writable

out = make_console()
err = make_console(stderr=True)


def say(kind: str, message: str) -> None:
    """One line on stderr; the message is plain text (no markup or emoji codes: specs contain colons)."""
    from rich.text import Text

    err.print(Text.assemble((f"{kind}: ", "bold red" if kind == "error" else "yellow"), message), soft_wrap=True)


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout goes to stderr for a while, file descriptor 1 included (os.write, C
    extensions), so --json owns stdout; sys.stdout still writes to the real stdout after."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 (a closed stream): Python's own redirect is all there is
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def run_command(compute: Callable[[], object], render: Callable[[object], None], *, json_: bool,
                plot: str | None = None, save_plot: Callable[[object, str], None] | None = None,
                html: str | None = None) -> None:
    """The edge, for every command: compute, print warnings, render (JSON or tables), plot, HTML page, exit code.

    A TBlockError or running out of memory becomes one line on stderr and its exit code; a block's own
    prints go to stderr while --json owns stdout.
    """
    from tblock_cli.errors import exits_guarded, is_out_of_memory

    try:
        if plot is not None:
            check_plot_target(plot)
        if html is not None:
            from tblock_cli.render.html import ensure_html_target

            ensure_html_target(html)
        with stdout_to_stderr() if json_ else contextlib.nullcontext(), exits_guarded():
            report = compute()
        for w in report.run.warnings if report.run else ():
            say("warning", w)
        if json_:
            from tblock_cli.report import dumps

            print(dumps(report.to_dict()))
        else:
            render(report)
        if plot is not None:
            try:
                save_plot(report, plot)
            except OSError as e:
                raise ConfigError(f"--plot {plot}: cannot write it: {e.strerror or e}") from None
            err.print(f"saved {plot}", highlight=False, markup=False)
        if html is not None:
            from tblock_cli.render.html import save_html

            save_html(report, html)
            err.print(f"saved {html}", highlight=False, markup=False)
    except TBlockError as e:
        say("error", str(e))
        raise typer.Exit(e.exit_code) from None
    except SystemExit as e:  # the block's sys.exit() where no check caught it: never a silent success
        say("error", f"the block called sys.exit({e.code!r}), which would have ended tblock; a block must return")
        raise typer.Exit(1) from None
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        say("error", f"out of memory; {OOM_HINT}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if report.ok else 1)


def check_plot_target(path: str) -> None:
    """Refuse, before measuring, a plot that could not be written: wrong suffix, no matplotlib, no such folder."""
    import importlib.util

    if not os.path.isdir(path) and os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path}: use a .png, .svg or .pdf file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'tblock[plot]'")
    ensure_writable(path, "--plot")
