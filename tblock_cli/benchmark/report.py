"""What bench measured: one result per point, breakdowns, comparisons with a saved run, and the findings (as data)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tblock_cli.benchmark.timing import NOISY_IQR, SLOW_TAIL, Latency
from tblock_cli.report import Finding, RunInfo, Status, failing_of

MODES = ("infer", "train")
# A cache class keeps a few bookkeeping tensors beside keys and values (HF's DynamicCache: 8 bytes at 2 layers, a
# position counter); up to this share of the expected size the cache still "holds what it should".
CACHE_BOOKKEEPING = 0.01
# --compare: a point whose peak memory grew by more than this is a regression (memory is exact).
MEMORY_GROWTH_MAX = 0.01
# A latency difference is stated, and --compare calls a point slower, when the IQRs are apart and the
# medians differ by more than this: two runs of one config on a quiet 2-core machine drift by a few
# percent with tight IQRs.
SLOWER_MIN = 0.05


@dataclass(frozen=True)
class BenchResult:
    mode: str  # infer: eval + inference_mode forward; train: train-mode forward + backward; decode: one token
    seq: int
    need_weights: bool | None  # forced value; None = the block as written
    target: str  # "block" or "torch" (nn.TransformerEncoderLayer baseline)
    latency: Latency
    peak_bytes: int
    memory_source: str
    attention_kernel: str
    materialises: bool  # the kernel holds the (L, S) attention matrix
    flops: int | None  # per call, analytic (built-in) or traced (user block)
    tokens: int  # tokens per call
    kv_cache: bool | None = None  # decode only: with the cache, or recomputing the prefix
    cache_bytes: int | None = None  # decode with the cache: bytes it held after the last token
    per_position: tuple[float, ...] = ()  # decode: seconds for the token at each position

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.latency.median

    @property
    def flops_per_s(self) -> float | None:
        return self.flops / self.latency.median if self.flops else None

    @property
    def noisy(self) -> bool:
        """Decode samples spread with position by design (growth is reported apart): not noise."""
        return self.mode != "decode" and self.latency.noisy

    @property
    def key(self) -> tuple:
        return (self.mode, self.seq, self.need_weights, self.target, self.kv_cache)

    @property
    def growth(self) -> float | None:
        """Decode: per-token time of the last quarter of positions over the first quarter's."""
        return growth(self.per_position) if self.per_position else None


@dataclass(frozen=True)
class Breakdown:
    """Per-component time and peak memory of one forward, against the whole forward's time."""

    seq: int
    parts: tuple[tuple[str, float, int, int], ...]  # (component, median seconds per forward, peak bytes, calls)
    whole: Latency  # the same forward timed without the per-op clock
    conditions: str

    @property
    def parts_sum(self) -> float:
        return sum(p[1] for p in self.parts)

    def share(self, seconds: float) -> float:
        """A time as a fraction of the whole forward's median."""
        return seconds / self.whole.median


@dataclass(frozen=True)
class Comparison:
    key: tuple
    label: str
    ratio: float | None  # new median / saved median
    slower: bool  # beyond the noise (IQRs do not overlap) and ratio > 1
    faster: bool
    memory_delta: int | None  # new peak - saved peak, bytes
    memory_grew: bool  # by more than MEMORY_GROWTH_MAX
    noisy: tuple[str, ...] = ()  # "this run", "the saved run": whose samples were noisy; then no latency verdict

    @property
    def inconclusive(self) -> bool:
        """Noisy, and not so far apart that the noise could not explain it (then slower or faster stands)."""
        return bool(self.noisy) and not (self.slower or self.faster)


@dataclass(frozen=True)
class BenchReport:
    subject: str
    results: tuple[BenchResult, ...]
    attention_bytes: dict  # seq -> {"weights_returned": B L S item, "matrix_per_head": B H L S item}
    batch: int
    heads: int
    dropout: float
    environment: dict
    encoder_layers: bool = False  # the block contains nn.TransformerEncoderLayer (a fused path hooks switch off)
    run: RunInfo | None = None
    breakdowns: tuple[Breakdown, ...] = ()
    comparisons: tuple[Comparison, ...] | None = None  # against a saved run, when --compare was given
    decode_analytic_bytes: int | None = None  # what the cache should hold: see decode_expected_from
    timed_s: float = 0.0  # seconds spent inside timed samples
    wall_s: float = 0.0  # seconds the whole measurement took
    trainable: bool = True  # the block has trainable parameters (else train mode's backward reaches the input only)
    train_skipped: bool = False  # train mode was asked for, but the output has no gradient path at all
    decode_expected_from: str = "d_model"  # decode_analytic_bytes from d_model (built-in), or "trace": the traced k/v widths

    @property
    def failing(self) -> tuple[Finding, ...]:
        return failing_of(self.findings)

    @property
    def ok(self) -> bool:
        return not self.failing

    def to_dict(self) -> dict:
        body = {
            "results": [result_dict(r) for r in self.results],
            "attention_bytes": self.attention_bytes,
            "findings": self.findings,
            "timing": {"timed_s": self.timed_s, "wall_s": self.wall_s},
        }
        if self.decode_analytic_bytes is not None:
            body["decode_analytic_cache_bytes"] = self.decode_analytic_bytes
        if self.breakdowns:
            body["breakdown"] = [{"seq": b.seq, "conditions": b.conditions, "whole_ms": b.whole.median * 1e3,
                                  "parts_sum_ms": b.parts_sum * 1e3,
                                  "parts": [{"component": c, "ms": t * 1e3, "peak_bytes": m, "calls": n} for c, t, m, n in b.parts]}
                                 for b in self.breakdowns]
        if self.comparisons is not None:
            body["comparison"] = [{"point": c.label, "latency_ratio": c.ratio, "slower": c.slower, "faster": c.faster,
                                   "peak_bytes_delta": c.memory_delta, "memory_grew": c.memory_grew,
                                   "inconclusive": c.inconclusive, "noisy": list(c.noisy)} for c in self.comparisons]
        return (self.run or RunInfo(self.subject, {}, self.environment)).envelope("bench", self.ok, body)

    def pair(self, mode: str, seq: int) -> tuple[BenchResult, BenchResult] | None:
        """(need_weights=False, need_weights=True) for one point, when both were measured."""
        on = off = None
        for r in self.results:
            if r.mode == mode and r.seq == seq and r.target == "block":
                if r.need_weights is True:
                    on = r
                elif r.need_weights is False:
                    off = r
        return (off, on) if on and off else None

    def on_off(self, mode: str, seq: int) -> tuple[float, int] | None:
        """need_weights on / off: (latency ratio of the medians, peak bytes on - off), when both were measured."""
        p = self.pair(mode, seq)
        if not p:
            return None
        off, on = p
        return on.latency.median / off.latency.median, on.peak_bytes - off.peak_bytes

    def against_torch(self, mode: str, seq: int) -> tuple[BenchResult, float] | None:
        """The block's run (as written, or need_weights off) and its median over the torch baseline's."""
        rows = [r for r in self.results if r.mode == mode and r.seq == seq]
        base = next((r for r in rows if r.target == "torch"), None)
        mine = next((r for r in rows if r.target == "block" and r.need_weights in (None, False)), None)
        return (mine, mine.latency.median / base.latency.median) if base and mine else None

    def decode_pair(self) -> tuple[BenchResult, BenchResult] | None:
        cached = next((r for r in self.results if r.mode == "decode" and r.kv_cache), None)
        full = next((r for r in self.results if r.mode == "decode" and r.kv_cache is False), None)
        return (cached, full) if cached and full else None

    @property
    def findings(self) -> tuple[Finding, ...]:
        """What the measurements say, as data; every latency difference is weighed against its noise."""
        out = []
        forced = any(r.need_weights is not None for r in self.results)
        if forced and self.subject.startswith("hf:"):
            out.append(Finding(Status.INFO, "bench.hf_need_weights"))
        if forced and self.encoder_layers:
            out.append(Finding(Status.INFO, "bench.encoder_layer_path"))
        if not self.trainable and any(r.mode == "train" for r in self.results):
            out.append(Finding(Status.INFO, "bench.train_input_only"))
        if self.train_skipped:
            out.append(Finding(Status.WARN, "bench.train_skipped"))
        math_seqs = sorted({r.seq for r in self.results if r.mode == "train" and r.target == "block" and r.need_weights is not True
                            and "SDPA math" in r.attention_kernel})
        if math_seqs and self.dropout > 0 and self.environment.get("device") == "cpu":
            out.append(Finding(Status.INFO, "bench.math_kernel", {"seqs": math_seqs, "dropout": self.dropout}))
        for mode in MODES:
            for seq in sorted({r.seq for r in self.results}):
                p = self.pair(mode, seq)
                if not p:
                    continue
                off, on = p
                saved = on.peak_bytes - off.peak_bytes
                matrix = self.attention_bytes[seq]["matrix_per_head"]
                out.append(Finding(Status.INFO, "bench.need_weights", {
                    "mode": mode, "seq": seq, "kernel_off": off.attention_kernel, "kernel_on": on.attention_kernel,
                    "materialises": off.materialises, "saved_bytes": saved, "matrix_bytes": matrix,
                    "matrix_fraction": saved / matrix, "latency": latency_verdict(off.latency, on.latency, "off", "on")}))
        d = self.decode_pair()
        if d:
            cached, full = d
            out.append(Finding(Status.INFO, "bench.decode", {
                "tokens": len(cached.per_position), "prompt": cached.seq, "cached_ms": cached.latency.median * 1e3,
                "recomputed_ms": full.latency.median * 1e3,
                "latency": latency_verdict(cached.latency, full.latency, "cached", "recomputed")}))
            out.append(Finding(Status.INFO, "bench.decode_growth", {"cached": cached.growth, "recomputed": full.growth}))
            if cached.cache_bytes is not None and self.decode_analytic_bytes:
                extra = cached.cache_bytes - self.decode_analytic_bytes
                same = 0 <= extra <= CACHE_BOOKKEEPING * self.decode_analytic_bytes
                out.append(Finding(Status.INFO if same else Status.WARN, "bench.cache_bytes" if same else "bench.cache_bytes_differ",
                                   {"bytes": cached.cache_bytes, "analytic": self.decode_analytic_bytes,
                                    "from": self.decode_expected_from}))
        noisy = [r for r in self.results if r.noisy]
        if noisy:
            out.append(Finding(Status.WARN, "bench.noisy", {"count": len(noisy), "threads": self.environment.get("threads"),
                                                            "iqr_limit": NOISY_IQR, "tail_limit": SLOW_TAIL}))
        for c in self.comparisons or ():
            facts = {"point": c.label, "ratio": c.ratio, "slower": c.slower, "memory_delta": c.memory_delta,
                     "memory_grew": c.memory_grew}
            if c.slower or c.memory_grew:
                out.append(Finding(Status.FAIL, "bench.regression", facts))
            if c.inconclusive:
                out.append(Finding(Status.WARN, "bench.inconclusive", {**facts, "noisy": list(c.noisy)}))
        return tuple(out)


def result_dict(r: BenchResult) -> dict:
    d = {
        "mode": r.mode, "seq": r.seq, "need_weights": r.need_weights, "target": r.target,
        "latency_ms": {"median": r.latency.median * 1e3, "iqr": r.latency.iqr * 1e3,
                       "samples": [x * 1e3 for x in r.latency.samples], "number_per_sample": r.latency.number_per_sample,
                       "noisy": r.noisy},
        "peak_bytes": r.peak_bytes, "memory_source": r.memory_source,
        "attention_kernel": r.attention_kernel, "materialises_attention": r.materialises,
        "tokens_per_s": r.tokens_per_s, "flops": r.flops, "flops_per_s": r.flops_per_s,
    }
    if r.mode == "decode":
        d.update({"kv_cache": r.kv_cache, "cache_bytes": r.cache_bytes, "per_position_ms": [x * 1e3 for x in r.per_position],
                  "growth_last_over_first_quarter": r.growth})
    return d

def latency_verdict(a: Latency, b: Latency, a_name: str, b_name: str) -> dict:
    """Whether a is faster than b beyond the noise: the IQRs apart and the medians more than SLOWER_MIN apart."""
    ratio = b.median / a.median
    if not a.differs_from(b):
        verdict = "overlap"
    elif 1 / (1 + SLOWER_MIN) < ratio < 1 + SLOWER_MIN:
        verdict = "within"
    else:
        verdict = "faster" if ratio > 1 else "slower"
    return {"a": a_name, "b": b_name, "ratio": ratio, "verdict": verdict, "within": SLOWER_MIN}


def growth(per_position: tuple[float, ...]) -> float:
    """Median time of the last quarter of positions over the first quarter's."""
    n = max(1, len(per_position) // 4)
    return statistics.median(per_position[-n:]) / statistics.median(per_position[:n])

