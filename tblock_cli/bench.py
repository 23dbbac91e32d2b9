"""Latency, peak memory and attention kernel of a block, with need_weights forced on and off."""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import anatomy, runtime
from tblock_cli.config import BlockConfig
from tblock_cli.errors import ConfigError, reraise_as_measure_error
from tblock_cli.loading import Subject
from tblock_cli.profiling import attention_kernel, profile_call

MODES = ("infer", "train")
# torch.utils.benchmark warns when the IQR exceeds 10 % of the median; tblock flags the same.
NOISY_IQR = 0.10
# blocked_autorange stops after min_time even if a single call took longer; a median and an IQR
# need a few samples, so slow calls are timed again, one call per sample, up to this many.
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Latency:
    samples: tuple[float, ...]  # seconds per call, one per timed block of calls

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[2] - q[0]

    @property
    def noisy(self) -> bool:
        return self.iqr > NOISY_IQR * self.median


@dataclass(frozen=True)
class BenchResult:
    mode: str  # infer: eval + inference_mode forward; train: train-mode forward + backward
    seq: int
    need_weights: bool | None  # forced value; None = the block as written
    target: str  # "block" or "torch" (nn.TransformerEncoderLayer baseline)
    latency: Latency
    peak_bytes: int
    memory_source: str
    attention_kernel: str
    materialises: bool  # the kernel holds the (L, S) attention matrix
    flops: int | None  # per call, analytic (built-in) or counted (user block)
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.latency.median

    @property
    def flops_per_s(self) -> float | None:
        return self.flops / self.latency.median if self.flops else None


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

    def findings(self) -> list[str]:
        """Sentences computed from the measurements: where need_weights=False saves, and where not."""
        out = []
        if any(r.need_weights is not None for r in self.results) and self.encoder_layers:
            out.append("the pre-hook that forces need_weights keeps nn.TransformerEncoderLayer off its fused encoder-layer "
                       "path (it falls back to nn.MultiheadAttention's own path); without --need-weights it runs the fused path")
        math = sorted({r.seq for r in self.results if r.mode == "train" and r.target == "block" and r.need_weights is not True
                       and "SDPA math" in r.attention_kernel})
        if math and self.dropout > 0 and self.environment["device"] == "cpu":
            out.append(f"train: SDPA ran its math kernel (it materialises the attention matrix) at seq {', '.join(map(str, math))}: "
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
                    out.append(
                        f"{mode}, seq {seq}: with need_weights=False the kernel ({off.attention_kernel}) still materialises "
                        f"the attention matrix; peak memory on - off = {saved / 2**20:+.1f} MiB, "
                        f"not the {matrix / 2**20:.1f} MiB of a (B, H, L, L) matrix"
                    )
                else:
                    out.append(
                        f"{mode}, seq {seq}: need_weights=False runs {off.attention_kernel} instead of {on.attention_kernel} and "
                        f"saves {saved / 2**20:.1f} MiB of peak memory ({saved / matrix:.2f}x the {matrix / 2**20:.1f} MiB (B, H, L, L) matrix)"
                        f" and {1 - off.latency.median / on.latency.median:.0%} of the time"
                    )
        return out


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
        module.zero_grad(set_to_none=True)
        call(x).backward(grad)
    return train


def time_call(fn: Callable[[], None], min_time: float) -> Latency:
    """torch.utils.benchmark.Timer: warm-up, CUDA sync, blocks of calls for at least min_time."""
    from torch.utils.benchmark import Timer

    fn()  # warm-up: allocator, lazy init, kernel selection
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    samples = list(timer.blocked_autorange(min_run_time=min_time).times)
    while len(samples) < MIN_SAMPLES:
        samples.extend(timer.timeit(number=1).times)
    return Latency(tuple(samples))


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
    """{"forward": ..., "train_step": ...} per call at this seq: analytic, or counted for a user block."""
    from dataclasses import replace

    from tblock_cli.params import param_report

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


def check_sizes(cfg: BlockConfig, seqs: list[int], modes: list[str], device: torch.device) -> None:
    """Refuse, before allocating anything, a sweep point estimated larger than the free memory."""
    for seq in seqs:
        est = runtime.estimate_bytes(cfg, seq=seq, train="train" in modes)
        runtime.ensure_fits(est, device, f"bench at seq {seq}")


def run_bench(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *, seqs: list[int],
              modes: list[str], need_weights: bool, baseline: bool, min_time: float,
              progress: Callable[[str], None] | None = None) -> BenchReport:
    points = plan(cfg, seqs, modes, need_weights, baseline)
    if need_weights and not anatomy.attention_modules(subject.module):
        raise ConfigError(f"--need-weights: {subject.name} has no nn.MultiheadAttention inside; need_weights is its option")
    torch.manual_seed(cfg.seed)
    torch_block = TorchBaseline(cfg).to(device=device, dtype=dtype) if baseline else None
    flops_cache: dict = {}
    results = []
    gen = torch.Generator().manual_seed(cfg.seed)
    for mode, seq, nw, target in points:
        if progress:
            progress(f"{mode} seq {seq}" + ("" if nw is None else f" need_weights={nw}") + (" (torch baseline)" if target == "torch" else ""))
        x = torch.randn(cfg.batch, seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
        module = subject.module if target == "block" else torch_block
        call = subject if target == "block" else torch_block
        was = module.training
        module.train(mode == "train")
        try:
            with forced_need_weights(module, nw) as hooked:
                fn = step_fn(call, module, x, mode)
                try:
                    latency = time_call(fn, min_time)
                    prof = profile_call(fn, device)
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
    item = torch.empty((), dtype=dtype).element_size()
    sizes = {s: {"weights_returned": cfg.batch * s * s * item, "matrix_per_head": cfg.batch * cfg.n_heads * s * s * item} for s in seqs}
    has_tel = any(isinstance(m, nn.TransformerEncoderLayer) for m in subject.module.modules())
    return BenchReport(subject.name, tuple(results), sizes, cfg.batch, cfg.n_heads, cfg.dropout, runtime.environment(device, dtype), has_tel)
