"""Saved runs: written by bench --save, read back by --compare and compared point by point."""

from __future__ import annotations

from tblock_cli.benchmark.report import MEMORY_GROWTH_MAX, SLOWER_MIN, BenchReport, Comparison
from tblock_cli.benchmark.timing import Latency
from tblock_cli.config import COMPARED


def point_label(key: tuple) -> str:
    mode, seq, nw, target, kv = key
    extra = "" if nw is None else f" need_weights={'on' if nw else 'off'}"
    extra += "" if target == "block" else f" ({target})"
    extra += "" if kv is None else (" cached" if kv else " recomputed")
    return f"{mode} seq {seq}{extra}"


# Config keys that must match for two runs to be compared point by point: the shared flags declared
# compared (threads, seed may differ), then the block and bench's own (min_time may differ).
COMPARED_CONFIG = COMPARED + ("block", "kwargs", "mode", "need_weights", "baseline", "decode")


def compare(report: BenchReport, saved: dict) -> list[Comparison]:
    """Each point of this run against the same point of a saved one."""
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
        ratio = r.latency.median / then.median if then.median else None
        apart = r.latency.differs_from(then)
        delta = r.peak_bytes - o["peak_bytes"] if r.peak_bytes >= 0 and o.get("peak_bytes", -1) >= 0 else None
        grew = delta is not None and o["peak_bytes"] > 0 and delta / o["peak_bytes"] > MEMORY_GROWTH_MAX
        out.append(Comparison(r.key, point_label(r.key), ratio, apart and ratio is not None and ratio > 1 + SLOWER_MIN,
                              apart and ratio is not None and ratio < 1 / (1 + SLOWER_MIN), delta, grew))
    return out


def config_mismatch(saved: dict, config: dict, environment: dict) -> list[str]:
    """The keys where a saved run's config differs from this one's."""
    diffs = []
    theirs = saved.get("config", {})
    for k in COMPARED_CONFIG:
        a, b = theirs.get(k), config.get(k)
        if isinstance(a, list) or isinstance(b, (list, tuple)):
            a, b = list(a or []), list(b or [])
        if a != b:
            diffs.append(f"{k} {a!r} -> {b!r}")
    if saved.get("environment", {}).get("device") != environment.get("device"):
        diffs.append(f"device {saved.get('environment', {}).get('device')!r} -> {environment.get('device')!r}")
    return diffs

