"""What bench measured: one result per point, breakdowns, comparisons with a saved run, and the findings."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tblock_cli.benchmark.timing import NOISY_IQR, SLOW_TAIL, Latency
from tblock_cli.report import Finding, RunInfo, Status
from tblock_cli.units import fmt_bytes

MODES = ("infer", "train")
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


@dataclass(frozen=True)
class Comparison:
    key: tuple
    label: str
    ratio: float | None  # new median / saved median
    slower: bool  # beyond the noise (IQRs do not overlap) and ratio > 1
    faster: bool
    memory_delta: int | None  # new peak - saved peak, bytes
    memory_grew: bool  # by more than MEMORY_GROWTH_MAX


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
    decode_analytic_bytes: int | None = None  # 2 x layers x batch x positions x d_model x item
    timed_s: float = 0.0  # seconds spent inside timed samples
    wall_s: float = 0.0  # seconds the whole measurement took

    @property
    def ok(self) -> bool:
        return not any(c.slower or c.memory_grew for c in self.comparisons or ())

    def to_dict(self) -> dict:
        body = {
            "results": [result_dict(r) for r in self.results],
            "attention_bytes": self.attention_bytes,
            "findings": self.findings(),
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
                                   "peak_bytes_delta": c.memory_delta, "memory_grew": c.memory_grew} for c in self.comparisons]
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

    def decode_pair(self) -> tuple[BenchResult, BenchResult] | None:
        cached = next((r for r in self.results if r.mode == "decode" and r.kv_cache), None)
        full = next((r for r in self.results if r.mode == "decode" and r.kv_cache is False), None)
        return (cached, full) if cached and full else None

    def findings(self) -> list[Finding]:
        """What the measurements say; every latency difference is weighed against its noise."""
        out = []
        info = lambda text: out.append(Finding(Status.INFO, text))  # noqa: E731
        if any(r.need_weights is not None for r in self.results) and self.subject.startswith("hf:"):
            info("Hugging Face layer: need_weights is output_attentions; its sdpa attention returns no weights (transformers "
                 "warns and suggests eager), so 'on' runs the eager implementation: what asking the model for attentions costs")
        if any(r.need_weights is not None for r in self.results) and self.encoder_layers:
            info("the pre-hook that forces need_weights keeps nn.TransformerEncoderLayer off its fused encoder-layer "
                 "path (it falls back to nn.MultiheadAttention's own path); without --need-weights it runs the fused path")
        math_seqs = sorted({r.seq for r in self.results if r.mode == "train" and r.target == "block" and r.need_weights is not True
                            and "SDPA math" in r.attention_kernel})
        if math_seqs and self.dropout > 0 and self.environment.get("device") == "cpu":
            info(f"train: SDPA ran its math kernel (it materialises the attention matrix) at seq {', '.join(map(str, math_seqs))}: "
                 f"attention dropout {self.dropout:g} is on, and the fused CPU kernel takes no dropout; --dropout 0 shows the fused kernel")
        for mode in MODES:
            for seq in sorted({r.seq for r in self.results}):
                p = self.pair(mode, seq)
                if not p:
                    continue
                off, on = p
                saved = on.peak_bytes - off.peak_bytes
                matrix = self.attention_bytes[seq]["matrix_per_head"]
                if off.materialises:
                    mem = (f"with need_weights=False the kernel ({off.attention_kernel}) still materialises the attention matrix; "
                           f"peak memory on - off = {saved / 2**20:+.1f} MiB, not the {matrix / 2**20:.1f} MiB of a (B, H, L, L) matrix")
                else:
                    mem = (f"need_weights=False runs {off.attention_kernel} instead of {on.attention_kernel} and saves "
                           f"{saved / 2**20:.1f} MiB of peak memory ({saved / matrix:.2f}x the {matrix / 2**20:.1f} MiB (B, H, L, L) matrix)")
                info(f"{mode}, seq {seq}: {mem}; {latency_sentence(off.latency, on.latency, 'off', 'on')}")
        d = self.decode_pair()
        if d:
            cached, full = d
            info(f"decode {len(cached.per_position)} tokens after a {cached.seq}-token prompt: with the cache "
                 f"{cached.latency.median * 1e3:.3f} ms/token, recomputing the prefix {full.latency.median * 1e3:.3f} ms/token; "
                 f"{latency_sentence(cached.latency, full.latency, 'cached', 'recomputed')}")
            info(f"per-token time from the first to the last quarter of positions: cached x{growth(cached.per_position):.2f}, "
                 f"recomputed x{growth(full.per_position):.2f} (recomputing grows with the prefix, the cache should not much)")
            if cached.cache_bytes is not None and self.decode_analytic_bytes:
                same = cached.cache_bytes == self.decode_analytic_bytes
                out.append(Finding(Status.INFO if same else Status.WARN,
                                   f"cache holds {fmt_bytes(cached.cache_bytes)} ({cached.cache_bytes:,} bytes) after the last token; "
                                   f"2 x layers x batch x positions x d_model x bytes = {self.decode_analytic_bytes:,}"
                                   + ("" if same else " : they differ (a cache of another width, or extra state)")))
        noisy = [r for r in self.results if r.noisy]
        if noisy:
            threads = self.environment.get("threads")
            out.append(Finding(Status.WARN, f"{len(noisy)} measurement(s) are noisy (IQR > {NOISY_IQR:.0%} of the median, or a median "
                                            f"> {SLOW_TAIL}x the fastest sample: other work competed for the cores); try --threads 1 "
                                            f"(ran with {threads}), a quieter machine, or a longer --min-time"))
        for c in self.comparisons or ():
            if c.slower or c.memory_grew:
                what = []
                if c.slower:
                    what.append(f"{c.ratio:.2f}x the saved latency, beyond the noise")
                if c.memory_grew:
                    what.append(f"peak memory {c.memory_delta:+,} bytes")
                out.append(Finding(Status.WARN, f"regression at {c.label}: " + ", ".join(what)))
        return out


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
                  "growth_last_over_first_quarter": growth(r.per_position)})
    return d

def latency_sentence(a: Latency, b: Latency, a_name: str, b_name: str) -> str:
    """'a is Nx faster than b' only when the IQRs do not overlap and the medians differ by more than SLOWER_MIN."""
    ratio = b.median / a.median
    if not a.differs_from(b):
        return f"no measurable latency difference between {a_name} and {b_name} (their IQRs overlap)"
    if 1 / (1 + SLOWER_MIN) < ratio < 1 + SLOWER_MIN:
        return f"no meaningful latency difference between {a_name} and {b_name} ({ratio:.2f}x: IQRs apart, but within {SLOWER_MIN:.0%})"
    if ratio > 1:
        return f"{a_name} is {ratio:.2f}x faster than {b_name} (IQRs apart)"
    return f"{a_name} is {1 / ratio:.2f}x slower than {b_name} (IQRs apart)"


def growth(per_position: tuple[float, ...]) -> float:
    """Median time of the last quarter of positions over the first quarter's."""
    n = max(1, len(per_position) // 4)
    return statistics.median(per_position[-n:]) / statistics.median(per_position[:n])

