"""Saved runs: written by bench --save, read back (and validated) by --compare, and compared point by point.

Reading and validating a file imports no torch, so a bad file is refused before anything is measured.
"""

from __future__ import annotations

import json
import math
import os

from tblock_cli.config import COMPARED
from tblock_cli.errors import ConfigError
from tblock_cli.report import SCHEMA_VERSION, ensure_writable, read_json

SAVED_MODES = ("infer", "train", "decode")
SAVED_TARGETS = ("block", "torch")


def point_label(key: tuple) -> str:
    mode, seq, nw, target, kv = key
    extra = "" if nw is None else f" need_weights={'on' if nw else 'off'}"
    extra += "" if target == "block" else f" ({target})"
    extra += "" if kv is None else (" cached" if kv else " recomputed")
    return f"{mode} seq {seq}{extra}"


# Config keys that must match for two runs to be compared point by point: the shared flags declared
# compared (threads, seed may differ), then the block and bench's own (min_time may differ).
COMPARED_CONFIG = COMPARED + ("block", "kwargs", "mode", "need_weights", "baseline", "decode")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _problem(data) -> str | None:
    """What makes `data` unusable as a saved bench run, or None. Every key --compare reads is checked here."""
    if not isinstance(data, dict) or data.get("command") != "bench" or not _is_int(data.get("schema_version")):
        return "not a tblock bench run (no schema_version / command 'bench')"
    if data["schema_version"] != SCHEMA_VERSION:
        return f"schema_version {data['schema_version']}, this tblock reads {SCHEMA_VERSION}"
    for key in ("config", "environment"):
        if not isinstance(data.get(key), dict):
            return f"'{key}' must be an object, got {type(data.get(key)).__name__}"
    results = data.get("results")
    if not isinstance(results, list) or not results:
        return "'results' must be a non-empty list of measured points"
    for i, r in enumerate(results):
        where = f"results[{i}]"
        if not isinstance(r, dict):
            return f"{where} must be an object"
        if r.get("mode") not in SAVED_MODES:
            return f"{where}.mode must be one of {', '.join(SAVED_MODES)}, got {r.get('mode')!r}"
        if not _is_int(r.get("seq")) or r["seq"] <= 0:
            return f"{where}.seq must be a positive integer, got {r.get('seq')!r}"
        if r.get("need_weights", "missing") not in (True, False, None):
            return f"{where}.need_weights must be true, false or null, got {r.get('need_weights', 'nothing')!r}"
        if r.get("target") not in SAVED_TARGETS:
            return f"{where}.target must be block or torch, got {r.get('target')!r}"
        if r.get("kv_cache") not in (True, False, None):
            return f"{where}.kv_cache must be true, false or null, got {r.get('kv_cache')!r}"
        if "peak_bytes" in r and not _is_int(r["peak_bytes"]):
            return f"{where}.peak_bytes must be an integer, got {r['peak_bytes']!r}"
        lat = r.get("latency_ms")
        if not isinstance(lat, dict):
            return f"{where}.latency_ms must be an object with samples"
        samples = lat.get("samples")
        if not isinstance(samples, list) or not samples or not all(_is_number(x) and x > 0 for x in samples):
            return f"{where}.latency_ms.samples must be a non-empty list of positive numbers (milliseconds), got {samples!r:.60}"
        n = lat.get("number_per_sample", 1)
        if not _is_int(n) or n < 1:
            return f"{where}.latency_ms.number_per_sample must be an integer >= 1, got {n!r}"
    return None


def validate_saved(data, source: str = "--compare") -> dict:
    """The saved run itself, or a ConfigError naming what is wrong with it (before anything is measured)."""
    problem = _problem(data)
    if problem:
        raise ConfigError(f"{source}: {problem}; give a file written by tblock bench --save")
    return data


def load_saved(path: str, flag: str = "--compare") -> dict:
    """A run saved by bench --save, read and validated; one clear line for anything else."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} needs the name of a file written by tblock bench --save")
    data = read_json(path, flag, "a file written by tblock bench --save")
    return validate_saved(data, f"{flag} {path}")


def ensure_save_target(path: str, flag: str = "--save") -> None:
    """Refuse, before measuring, a path that cannot be written or that holds something other than a saved run:
    an existing file is only replaced when it is a tblock bench run (or empty: nothing to lose)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{flag} needs a file name")
    ensure_writable(path, flag)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or data.get("command") != "bench" or not _is_int(data.get("schema_version")):
        raise ConfigError(f"{flag} {path}: the file exists and is not a tblock bench run; refusing to overwrite it "
                          f"(give a new file name, or remove it first)")


# A noisy point still gets a latency verdict when every sample of one run is this many times every sample of the
# other: contention from other work slowed bench's samples by at most 5x on a 2-core machine with 8 busy processes
# beside it (each gets 2/10 of the cores), so 10x is beyond what load can do.
CLEAR_FACTOR = 10.0


def compare(report, saved: dict) -> list:
    """Each point of this run against the same point of a saved (validated) one.

    A point whose samples were noisy in either run gets no latency verdict (inconclusive): a median
    taken while other work competed for the cores says nothing about the code, unless the two runs'
    samples are CLEAR_FACTOR apart. Memory is exact and is judged regardless.
    """
    from tblock_cli.benchmark.report import MEMORY_GROWTH_MAX, SLOWER_MIN, Comparison
    from tblock_cli.benchmark.timing import Latency

    old = {}
    for r in saved.get("results", []):
        key = (r["mode"], r["seq"], r["need_weights"], r["target"], r.get("kv_cache"))
        old[key] = r
    out = []
    for r in report.results:
        o = old.get(r.key)
        if o is None:
            continue
        then = Latency(tuple(s / 1e3 for s in o["latency_ms"]["samples"]), o["latency_ms"].get("number_per_sample", 1))
        judged = o["latency_ms"].get("noisy")
        saved_noisy = judged if isinstance(judged, bool) else then.noisy  # as judged then; from its samples if not saved
        noisy = tuple(who for who, was in (("this run", r.latency.noisy), ("the saved run", saved_noisy)) if was and r.mode != "decode")
        ratio = r.latency.median / then.median if then.median else None
        # Noise widens the quartiles but cannot move every sample of one run past every sample of the other by
        # CLEAR_FACTOR: such a difference is the code's, however noisy either run was.
        clear = bool(noisy) and (min(r.latency.samples) > CLEAR_FACTOR * max(then.samples)
                                 or max(r.latency.samples) * CLEAR_FACTOR < min(then.samples))
        apart = r.latency.differs_from(then) and (not noisy or clear)
        delta = r.peak_bytes - o["peak_bytes"] if r.peak_bytes >= 0 and o.get("peak_bytes", -1) >= 0 else None
        grew = delta is not None and o["peak_bytes"] > 0 and delta / o["peak_bytes"] > MEMORY_GROWTH_MAX
        out.append(Comparison(r.key, point_label(r.key), ratio, apart and ratio is not None and ratio > 1 + SLOWER_MIN,
                              apart and ratio is not None and ratio < 1 / (1 + SLOWER_MIN), delta, grew, noisy))
    return out


def _as_list(v) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [] if v is None else [v]


def config_mismatch(saved: dict, config: dict, environment: dict) -> list[str]:
    """The keys where a saved run's config differs from this one's."""
    diffs = []
    theirs = saved.get("config", {})
    for k in COMPARED_CONFIG:
        a, b = theirs.get(k), config.get(k)
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            a, b = _as_list(a), _as_list(b)
        if a != b:
            diffs.append(f"{k} {a!r} -> {b!r}")
    if saved.get("environment", {}).get("device") != environment.get("device"):
        diffs.append(f"device {saved.get('environment', {}).get('device')!r} -> {environment.get('device')!r}")
    return diffs
