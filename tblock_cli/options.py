"""Every option rule of every command, judged with no torch imported: the first line of each API function.

The CLI parses flags into these option names and calls the API, so a bad value is refused in a blink, before
torch loads, and each rule (and its sentence) exists once. What needs the machine (a device that is not there, a
dtype it cannot run) or the block (its width, its heads) is judged later, where those are known.
"""

from __future__ import annotations

import math
from typing import Callable

from tblock_cli.config import FLAGS, build_config, check_type, check_values, parse_kwargs, preset_values
from tblock_cli.errors import ConfigError, LoadError

# --min-time is capped so a typo (600000) cannot hold the machine for days.
MAX_MIN_TIME = 600.0
MAX_DECODE = 65536
# torch.compile backends compare can hold A against, cheapest last: inductor generates and builds kernels,
# aot_eager runs dynamo's graphs through AOTAutograd with eager kernels, eager runs dynamo's graphs as they are.
# Stepping down the list says whether a difference comes from inductor's kernels, from autograd tracing or from
# dynamo itself.
BACKENDS = ("inductor", "aot_eager", "eager")
BUILTIN = "builtin"  # compare's name for the built-in block


def check_options(values: dict, **types: type) -> None:
    """An API caller's own keyword values (strict=, tree_depth=, ...) of the wrong type, as a ConfigError naming them."""
    for name, kind in types.items():
        value = values.get(name)
        if value is None:
            continue
        if kind is Callable:
            if not callable(value):
                raise ConfigError(f"{name} must be a function, got {value!r}")
        elif kind is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a dict (a saved run, as api.load_saved returns), got {type(value).__name__}")
        else:
            check_type(name, value, kind)


def shared(block, options: dict, *, allow_mixed: bool = False) -> None:
    """The shared flags (the BlockConfig fields, --preset, --kwargs): names, types, ranges, choices; for the built-in
    block the whole config (--d-model divisible by --n-heads), which a user block's inferred sizes may still fill."""
    if block is not None and not isinstance(block, str) and not callable(block):
        raise ConfigError(f"block must be an nn.Module, a factory, a SPEC string or None, got {type(block).__name__}")
    given = {k: v for k, v in options.items() if v is not None}
    preset, kwargs = given.pop("preset", None), given.pop("kwargs", None)
    unknown = sorted(set(given) - set(FLAGS))
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(FLAGS)}, preset, kwargs")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"--preset must be a string, got {preset!r}")
    check_values(given, allow_mixed=allow_mixed)
    preset_values(preset)
    if kwargs is not None:
        if block is None:
            raise LoadError("--kwargs only applies with --block SPEC")
        if not isinstance(kwargs, (str, dict)):
            raise ConfigError("kwargs must be a dict or a JSON object string")
        if isinstance(kwargs, str):
            parse_kwargs(kwargs)
    elif block is None:
        build_config(preset, allow_mixed=allow_mixed, **given)


def declared(like, like_kwargs, expect) -> None:
    """What a block is declared to be: --like hf:TYPE, --like-kwargs JSON, --expect KEY=VALUE (spec and check)."""
    from tblock_cli.card.declare import validate

    validate(like, like_kwargs, expect)


def spec(block, options: dict, *, like, like_kwargs, expect, progress) -> None:
    """tblock spec's options."""
    check_options({"progress": progress}, progress=Callable)
    shared(block, options)
    declared(like, like_kwargs, expect)


def check(block, options: dict, *, strict, progress, fast, tp, fsdp, tp_plan, like=None, like_kwargs=None,
          expect=None) -> None:
    """tblock check's options."""
    check_options({"strict": strict, "progress": progress, "tp": tp, "fsdp": fsdp, "tp_plan": tp_plan, "fast": fast},
                  strict=bool, progress=Callable, tp=int, fsdp=int, tp_plan=str, fast=bool)
    shared(block, options)
    declared(like, like_kwargs, expect)
    if tp_plan is not None and not tp:
        raise ConfigError("--tp-plan needs --tp N")
    for flag, n in (("--tp", tp), ("--fsdp", fsdp)):
        if n is not None and n < 2:
            raise ConfigError(f"{flag} {n}: a world of fewer than 2 ranks shards nothing; give 2 or more")


def params(block, options: dict, *, tree_depth) -> None:
    """tblock params' options."""
    check_options({"tree_depth": tree_depth}, tree_depth=int)
    shared(block, options)
    if tree_depth is not None and tree_depth < 1:
        raise ConfigError(f"--tree-depth must be >= 1, got {tree_depth}")


def parse_seqs(seq) -> list[int]:
    """'128,512', 512 or [128, 512] -> sorted distinct positive ints."""
    if isinstance(seq, bool) or not isinstance(seq, (int, str, list, tuple)) or \
            (isinstance(seq, (list, tuple)) and not all(isinstance(n, int) and not isinstance(n, bool) for n in seq)):
        raise ConfigError(f"--seq must be an integer, a list of integers or a comma-separated string, got {seq!r}")
    if isinstance(seq, str):
        parts = [s for s in seq.replace(" ", "").split(",") if s]
        if not parts:
            raise ConfigError(f"--seq takes a comma-separated list of integers, e.g. 128,512; got {seq!r}")
        try:
            seqs = [int(s) for s in parts]
        except ValueError:
            raise ConfigError(f"--seq takes a comma-separated list of integers, e.g. 128,512; got {seq!r}") from None
    elif isinstance(seq, int):
        seqs = [seq]
    else:
        seqs = [int(s) for s in seq]
    if not seqs or any(s <= 0 for s in seqs):
        raise ConfigError(f"--seq values must be > 0, got {seq!r}")
    for s in seqs:
        check_values({"seq": s})
    return sorted(set(seqs))


# What bench sweeps when --seq and --mode are not given (bench --tp: the first sequence length, train mode only).
SEQ_DEFAULT = "128,512"
MODE_DEFAULT = "both"


def bench_defaults(seq, mode, tp: int | None) -> tuple[object, str]:
    """--seq and --mode as given, or their defaults. bench --tp times one train step (forward + backward) at one
    length: a second --seq or another --mode would be ignored, so it is refused instead."""
    if tp is not None:
        if seq is not None and len(parse_seqs(seq)) > 1:
            raise ConfigError(f"bench --tp times one sequence length; give one --seq, got {seq!r}")
        if mode is not None and mode != "train":
            raise ConfigError(f"bench --tp times the train step (forward + backward) alone; drop --mode {mode} "
                              f"(or give --mode train)")
        return (seq if seq is not None else SEQ_DEFAULT.split(",")[0]), "train"
    return (seq if seq is not None else SEQ_DEFAULT), (mode if mode is not None else MODE_DEFAULT)


def bench(block, options: dict, *, seq, need_weights, mode, baseline, min_time, decode, breakdown, compare_with,
          progress, tp, tp_plan) -> tuple[list[int], str]:
    """tblock bench's options; the sequence lengths to sweep, sorted, and the mode (defaults filled in)."""
    check_options(locals(), need_weights=bool, mode=str, baseline=str, min_time=float, decode=int, breakdown=bool,
                  compare_with=dict, progress=Callable, tp=int, tp_plan=str)
    shared(block, options)
    seq, mode = bench_defaults(seq, mode, tp)
    seqs = parse_seqs(seq)
    if mode not in ("infer", "train", "both"):
        raise ConfigError(f"--mode must be infer, train or both, got {mode!r}")
    if baseline not in (None, "torch"):
        raise ConfigError(f"--baseline takes 'torch', got {baseline!r}")
    if not (isinstance(min_time, (int, float)) and math.isfinite(min_time) and 0 < min_time <= MAX_MIN_TIME):
        raise ConfigError(f"--min-time must be a number of seconds in (0, {MAX_MIN_TIME:g}], got {min_time}")
    if decode is not None and not 1 <= decode <= MAX_DECODE:
        raise ConfigError(f"--decode must be in [1, {MAX_DECODE}], got {decode}")
    if compare_with is not None:
        from tblock_cli.benchmark.saved import validate_saved

        validate_saved(compare_with, "compare_with")
    if tp_plan is not None and not tp:
        raise ConfigError("--tp-plan needs --tp N")
    if tp is not None and tp < 2:
        raise ConfigError(f"--tp {tp}: a world of fewer than 2 ranks shards nothing; give 2 or more")
    if tp is not None or tp_plan is not None:
        given = [f for f, on in (("--decode", decode), ("--breakdown", breakdown), ("--baseline", baseline),
                                 ("--compare", compare_with is not None), ("--need-weights", need_weights)) if on]
        if given:
            raise ConfigError(f"bench --tp times the sharded forward + backward alone; drop {', '.join(given)}")
    return seqs, mode


def depth(block, options: dict, *, compare, strict) -> None:
    """tblock depth's options."""
    check_options({"compare": compare, "strict": strict}, compare=bool, strict=bool)
    shared(block, options, allow_mixed=True)
    if compare and (block is not None or options.get("norm") is not None):
        raise ConfigError("--compare runs the built-in pre, post and mixed stacks; drop --norm and --block")


def check_backend(backend: str | None, compile: bool) -> None:
    """--backend: one of BACKENDS, and only with --compile."""
    if backend is None:
        return
    if not compile:
        raise ConfigError("--backend picks torch.compile's backend: it needs --compile")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def compare(a, b, options: dict, *, kwargs_a, kwargs_b, dtype_b, compile, backend, atol, rtol, map_file) -> None:
    """tblock compare's options (each side's own block is judged when it is built)."""
    check_options({"compile": compile, "dtype_b": dtype_b, "backend": backend, "atol": atol, "rtol": rtol,
                   "map_file": map_file}, compile=bool, dtype_b=str, backend=str, atol=float, rtol=float, map_file=str)
    sides = (a,) if compile else (a, b)  # with --compile, B is A compiled
    builtin = any(side is None or side == BUILTIN for side in sides)
    shared(None if builtin else a, {k: v for k, v in options.items() if k != "kwargs"})  # a built-in side: flags alone
    side_options(kwargs_a, kwargs_b, dtype_b)
    for flag, tol in (("--atol", atol), ("--rtol", rtol)):
        if tol is None:
            continue
        if not math.isfinite(tol):  # inf passes every difference; NaN compares False with all: both judge nothing
            raise ConfigError(f"{flag} must be a finite number, got {tol}")
        if tol < 0:
            raise ConfigError(f"{flag} must be >= 0, got {tol}")
    check_backend(backend, compile)
    if compile:
        if b is not None or dtype_b or kwargs_b or map_file:
            raise ConfigError("--compile compares A with torch.compile(A): drop B, --kwargs-b, --dtype-b and --map")
    elif b is None:  # the built-in block is named "builtin": a forgotten B must not become one silently
        raise ConfigError('compare needs two blocks: B is missing (give "builtin" for the built-in block, or '
                          'compile=True / --compile to hold A against torch.compile(A))')


def side_options(kwargs_a, kwargs_b, dtype_b) -> None:
    """--kwargs-a, --kwargs-b and --dtype-b judged under their own names (setup would name --kwargs and --dtype)."""
    from tblock_cli.config import DTYPES

    for flag, text in (("--kwargs-a", kwargs_a), ("--kwargs-b", kwargs_b)):
        if text is None or isinstance(text, dict):
            continue
        if not isinstance(text, str):
            raise ConfigError(f"{flag} must be a JSON object string (or a dict), got {type(text).__name__}")
        parse_kwargs(text, flag)
    if dtype_b is not None and dtype_b not in DTYPES:
        raise ConfigError(f"--dtype-b must be one of {', '.join(DTYPES)}, got {dtype_b!r}")
