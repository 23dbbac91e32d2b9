"""bench's own flags checked, with no torch imported: a bad value is refused before anything loads."""

from __future__ import annotations

import math

from tblock_cli.config import check_values
from tblock_cli.errors import ConfigError

# --min-time is capped so a typo (600000) cannot hold the machine for days.
MAX_MIN_TIME = 600.0
MAX_DECODE = 65536


def parse_seqs(seq) -> list[int]:
    """'128,512', 512 or [128, 512] -> sorted distinct positive ints."""
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


def validate_bench(seq, mode: str, baseline: str | None, min_time: float, decode: int | None) -> list[int]:
    """Every bench-only flag checked before anything is built or measured."""
    seqs = parse_seqs(seq)
    if mode not in ("infer", "train", "both"):
        raise ConfigError(f"--mode must be infer, train or both, got {mode!r}")
    if baseline not in (None, "torch"):
        raise ConfigError(f"--baseline takes 'torch', got {baseline!r}")
    if not (isinstance(min_time, (int, float)) and math.isfinite(min_time) and 0 < min_time <= MAX_MIN_TIME):
        raise ConfigError(f"--min-time must be a number of seconds in (0, {MAX_MIN_TIME:g}], got {min_time}")
    if decode is not None and not 1 <= decode <= MAX_DECODE:
        raise ConfigError(f"--decode must be in [1, {MAX_DECODE}], got {decode}")
    return seqs
