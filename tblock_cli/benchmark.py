"""Latency, peak memory and attention kernel of a block: need_weights on and off, cached decoding, saved baselines."""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import anatomy, runtime
from tblock_cli.config import BlockConfig
from tblock_cli.errors import ConfigError, reraise_as_measure_error
from tblock_cli.loading import Subject
from tblock_cli.profiling import CallProfile, attention_kernel, profile_call
from tblock_cli.report import Finding, RunInfo, Status
from tblock_cli.units import fmt_bytes

MODES = ("infer", "train")
# torch.utils.benchmark warns when the IQR exceeds 10 % of the median; tblock flags the same.
NOISY_IQR = 0.10
# Contention (threads fighting for cores) shows as a slow tail: a median well above the fastest sample.
SLOW_TAIL = 1.5
# A median and an IQR need a few samples; calls faster than min_time / TARGET_SAMPLES are batched
# into one sample (number_per_sample), so a sample is long enough for the clock and the loop is cheap.
MIN_SAMPLES = 5
TARGET_SAMPLES = 20
# --compare: a point whose peak memory grew by more than this is a regression (memory is exact).
MEMORY_GROWTH_MAX = 0.01
# A latency difference is stated, and --compare calls a point slower, when the IQRs are apart and the
# medians differ by more than this: two runs of one config on a quiet 2-core machine drift by a few
# percent with tight IQRs.
SLOWER_MIN = 0.05
# --min-time is capped so a typo (600000) cannot hold the machine for days.
MAX_MIN_TIME = 600.0
MAX_DECODE = 65536


@dataclass(frozen=True)
class Latency:
    samples: tuple[float, ...]  # seconds per call: each the mean of number_per_sample back-to-back calls
    number_per_sample: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def quartiles(self) -> tuple[float, float]:
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def iqr(self) -> float:
        q1, q3 = self.quartiles()
        return q3 - q1

    @property
    def noisy(self) -> bool:
        return self.iqr > NOISY_IQR * self.median or self.median > SLOW_TAIL * min(self.samples)

    def differs_from(self, other: "Latency") -> bool:
        """True when the interquartile ranges do not overlap: a difference larger than the noise."""
        a1, a3 = self.quartiles()
        b1, b3 = other.quartiles()
        return a3 < b1 or b3 < a1


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


@contextmanager
def forced_need_weights(module: nn.Module, value: bool | None):
    """Every nn.MultiheadAttention inside is called with need_weights=value (None: untouched).

    Yields a list that grows by one per hooked call, so a caller can tell when no MHA forward ran
    (a fused path that bypasses the module would make the forcing a no-op).
    """
    calls: list[str] = []
    if value is None:
        yield calls
        return
    if hasattr(module, "attentions"):  # a Hugging Face layer: output_attentions is its need_weights
        with module.attentions(value):
            calls.append("output_attentions")
            yield calls
        return
    mhas = anatomy.attention_modules(module)
    if not mhas:
        raise ConfigError("--need-weights needs an nn.MultiheadAttention inside the block: need_weights is its option")

    def hook(mha, args, kwargs):
        calls.append(type(mha).__name__)
        bound = anatomy.mha_call_arguments(mha, args, kwargs)
        bound.arguments["need_weights"] = value
        return bound.args, bound.kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in mhas]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def step_fn(call: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, mode: str) -> Callable[[], None]:
    """One unit of work: an inference forward, or a training forward + backward from grads = None."""
    if mode == "infer":
        def infer():
            with torch.inference_mode():
                call(x)
        return infer

    grad = torch.ones_like(x)

    def train():
        module.zero_grad(set_to_none=True)  # the step starts where zero_grad(set_to_none=True) leaves a loop
        call(x).backward(grad)
    return train


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def time_samples(fn: Callable[[], None], device: torch.device, min_time: float, clock: list | None = None) -> Latency:
    """Timed calls until min_time and MIN_SAMPLES; calls shorter than min_time / TARGET_SAMPLES batched per sample.

    The caller has run fn once already (the warm-up). `clock`, when given, accumulates the seconds spent
    inside timed samples.
    """
    sync = synchronizer(device)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    number = max(1, int(min_time / TARGET_SAMPLES / max(first, 1e-9)))
    samples = [first] if number == 1 else []
    spent = first
    while spent < min_time or len(samples) < MIN_SAMPLES:
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        dt = time.perf_counter() - t0
        samples.append(dt / number)
        spent += dt
    if clock is not None:
        clock.append(spent)
    return Latency(tuple(samples), number)


def measure(fn: Callable[[], None], device: torch.device, min_time: float, clock: list) -> tuple[Latency, CallProfile]:
    """The profiled warm-up (peak memory, operators), then the timed samples."""
    prof = profile_call(fn, device)
    return time_samples(fn, device, min_time, clock), prof


class TorchBaseline(nn.Module):
    """PyTorch's own layers of the same shape: nn.TransformerEncoderLayer x layers (+ final LayerNorm)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        from tblock_cli.block import has_final_norm, layer_norms
        from tblock_cli.reference import encoder_layer

        self.layers = nn.ModuleList(encoder_layer(cfg, n) for n in layer_norms(cfg))
        self.final_ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias) if has_final_norm(cfg) else None
        self.causal = cfg.causal

    def forward(self, x):
        from tblock_cli.block import causal_mask

        mask = causal_mask(x.shape[1], x.device) if self.causal else None
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=self.causal)
        return self.final_ln(x) if self.final_ln is not None else x


def flops_at(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, seq: int) -> dict:
    """{"forward": ..., "train_step": ...} per call at this seq: analytic, or traced for a user block."""
    from dataclasses import replace

    from tblock_cli.counting import param_report

    try:
        return param_report(subject, replace(cfg, seq=seq), dtype).flops
    except Exception:  # noqa: BLE001 - FLOPs are a bonus; latency and memory still stand
        return {}


def call_name(target: str, subject: Subject) -> str:
    return "nn.TransformerEncoderLayer baseline" if target == "torch" else subject.name


def plan(cfg: BlockConfig, seqs: list[int], modes: list[str], need_weights: bool, baseline: bool) -> list[tuple]:
    points = []
    for mode in modes:
        for seq in seqs:
            for nw in ((False, True) if need_weights else (None,)):
                points.append((mode, seq, nw, "block"))
            if baseline:
                points.append((mode, seq, None, "torch"))
    return points


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
    return sorted(set(seqs))


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


def check_sizes(cfg: BlockConfig, seqs: list[int], modes: list[str], device: torch.device, decode: int | None = None) -> None:
    """Refuse, before allocating anything, a sweep point estimated larger than the free memory."""
    for seq in seqs + ([seqs[0] + decode] if decode else []):
        est = runtime.estimate_bytes(cfg, seq=seq, train="train" in modes)
        runtime.ensure_fits(est, device, f"bench at seq {seq}")


def run_bench(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *, seqs: list[int],
              modes: list[str], need_weights: bool, baseline: bool, min_time: float,
              progress: Callable[[str, int, int], None] | None = None, run: RunInfo | None = None,
              decode: int | None = None, breakdown: bool = False, compare_with: dict | None = None) -> BenchReport:
    started = time.perf_counter()
    points = plan(cfg, seqs, modes, need_weights, baseline) if modes else []
    if need_weights and not anatomy.attention_modules(subject.module) and not hasattr(subject.module, "attentions"):
        raise ConfigError(f"--need-weights: {subject.name} has no nn.MultiheadAttention inside; need_weights is its option")
    total = len(points) + (2 if decode else 0) + (len(seqs) if breakdown else 0)
    torch.manual_seed(cfg.seed)
    torch_block = TorchBaseline(cfg).to(device=device, dtype=dtype) if baseline else None
    flops_cache: dict = {}
    results = []
    clock: list[float] = []
    gen = torch.Generator().manual_seed(cfg.seed)
    for i, (mode, seq, nw, target) in enumerate(points):
        if progress:
            progress(f"{mode} seq {seq}" + ("" if nw is None else f" need_weights={nw}") + (" (torch baseline)" if target == "torch" else ""),
                     i, total)
        x = torch.randn(cfg.batch, seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
        module = subject.module if target == "block" else torch_block
        call = subject if target == "block" else torch_block
        was = module.training
        module.train(mode == "train")
        try:
            with forced_need_weights(module, nw) as hooked:
                module.zero_grad(set_to_none=True)
                fn = step_fn(call, module, x, mode)
                try:
                    latency, prof = measure(fn, device, min_time, clock)
                except Exception as e:  # noqa: BLE001 - the block under test raised
                    reraise_as_measure_error(e, f"{call_name(target, subject)} raised in {mode} mode at seq {seq}")
            if nw is not None and not hooked:
                raise ConfigError(f"--need-weights: no nn.MultiheadAttention forward ran in {subject.name}; a fused path bypassed it")
        finally:
            module.zero_grad(set_to_none=True)
            module.train(was)
        kernel, materialises = attention_kernel(prof.ops)
        if seq not in flops_cache:
            flops_cache[seq] = flops_at(subject, cfg, dtype, seq)
        flops = flops_cache[seq].get("forward" if mode == "infer" else "train_step")
        results.append(BenchResult(mode, seq, nw, target, latency, prof.peak_bytes, prof.source, kernel, materialises,
                                   flops, cfg.batch * seq))
    analytic = None
    if decode:
        from tblock_cli.kvcache import analytic_cache_bytes

        if progress:
            progress(f"decode {decode} tokens", len(points), total)
        results.extend(decode_results(subject, cfg, device, dtype, seqs[0], decode, clock))
        analytic = analytic_cache_bytes(cfg.layers, cfg.batch, seqs[0] + decode, cfg.d_model, dtype.itemsize)
    parts = []
    if breakdown:
        from tblock_cli.breakdown import breakdown as run_breakdown

        for j, seq in enumerate(seqs):
            if progress:
                progress(f"breakdown seq {seq}", len(points) + (2 if decode else 0) + j, total)
            x = torch.randn(cfg.batch, seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
            try:
                parts.append(run_breakdown(subject, cfg, x, device, min_time, clock))
            except Exception as e:  # noqa: BLE001
                reraise_as_measure_error(e, f"{subject.name} raised during --breakdown at seq {seq}")
    item = dtype.itemsize
    sizes = {s: {"weights_returned": cfg.batch * s * s * item, "matrix_per_head": cfg.batch * cfg.n_heads * s * s * item} for s in seqs}
    has_tel = any(isinstance(m, nn.TransformerEncoderLayer) for m in subject.module.modules())
    report = BenchReport(subject.name, tuple(results), sizes, cfg.batch, cfg.n_heads, cfg.dropout, runtime.environment(device, dtype),
                         has_tel, run, tuple(parts), None, analytic, sum(clock), time.perf_counter() - started)
    if compare_with is not None:
        from dataclasses import replace

        report = replace(report, comparisons=tuple(compare(report, compare_with)))
    return report


def decode_results(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, prompt: int, n: int,
                   clock: list) -> list[BenchResult]:
    """Generate n tokens after a prompt: with the block's cache, and by recomputing the whole prefix each step."""
    from tblock_cli import kvcache

    module = subject.module
    if not kvcache.has_decode(module):
        raise ConfigError(f"--decode: {subject.name} has no decode(x_t, cache) -> (y_t, cache) method (see docs/decoding.md)")
    sync = synchronizer(device)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch, prompt + n, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
    was = module.training
    module.eval()
    out = []
    try:
        with torch.inference_mode():
            kvcache.decode_step(module, x[:, :prompt], None)  # warm-up
            subject(x[:, : prompt + 1])
            for cached in (True, False):
                per, cache = [], None
                if cached:
                    _, cache = kvcache.decode_step(module, x[:, :prompt], None)  # prefill, not a generated token
                for t in range(prompt, prompt + n):
                    sync()
                    t0 = time.perf_counter()
                    if cached:
                        _, cache = kvcache.decode_step(module, x[:, t : t + 1], cache)
                    else:
                        subject(x[:, : t + 1])
                    sync()
                    per.append(time.perf_counter() - t0)
                clock.append(sum(per))
                size = kvcache.cache_bytes(cache) if cached else None
                lat = Latency(tuple(per))
                out.append(BenchResult("decode", prompt, None, "block", lat, -1, "not measured for decode", "-", False, None,
                                       cfg.batch, cached, size, tuple(per)))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        reraise_as_measure_error(e, f"{subject.name} raised while decoding")
    finally:
        module.train(was)
    return out


def point_label(key: tuple) -> str:
    mode, seq, nw, target, kv = key
    extra = "" if nw is None else f" need_weights={'on' if nw else 'off'}"
    extra += "" if target == "block" else f" ({target})"
    extra += "" if kv is None else (" cached" if kv else " recomputed")
    return f"{mode} seq {seq}{extra}"


# Config keys that must match for two runs to be compared point by point (threads, seed, min_time may differ).
COMPARED_CONFIG = ("d_model", "n_heads", "d_ff", "dropout", "norm", "activation", "eps", "bias", "causal", "layers", "batch",
                   "dtype", "block", "kwargs", "seq", "mode", "need_weights", "baseline", "decode")


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
