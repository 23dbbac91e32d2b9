"""Running a bench: the sweep of points, need_weights forced on and off, the torch baseline, cached decoding."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import runtime
from tblock_cli.anatomy.mha import attention_modules, mha_call_arguments
from tblock_cli.benchmark.profiling import attention_kernel
from tblock_cli.benchmark.report import BenchReport, BenchResult
from tblock_cli.benchmark.saved import compare
from tblock_cli.benchmark.timing import Latency, measure, step_fn, synchronizer
from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, ConfigError, MeasureError, reraise_as_measure_error
from tblock_cli.report import RunInfo
from tblock_cli.subject import Subject


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
    mhas = attention_modules(module)
    if not mhas:
        raise ConfigError("--need-weights needs an nn.MultiheadAttention inside the block: need_weights is its option")

    def hook(mha, args, kwargs):
        calls.append(type(mha).__name__)
        bound = mha_call_arguments(mha, args, kwargs)
        bound.arguments["need_weights"] = value
        return bound.args, bound.kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in mhas]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()



class TorchBaseline(nn.Module):
    """PyTorch's own layers of the same shape: nn.TransformerEncoderLayer x layers (+ final LayerNorm)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        from tblock_cli.subject.builtin import has_final_norm, layer_norms
        from tblock_cli.subject.reference import encoder_layer

        self.layers = nn.ModuleList(encoder_layer(cfg, n) for n in layer_norms(cfg))
        self.final_ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias) if has_final_norm(cfg) else None
        self.causal = cfg.causal

    def forward(self, x):
        from tblock_cli.subject.builtin import causal_mask

        mask = causal_mask(x.shape[1], x.device) if self.causal else None
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=self.causal)
        return self.final_ln(x) if self.final_ln is not None else x


def flops_at(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, seq: int) -> dict:
    """{"forward": ..., "train_step": ...} per call at this seq: analytic, or traced for a user block."""
    from dataclasses import replace

    from tblock_cli.params_report import param_report

    try:
        return param_report(subject, replace(cfg, seq=seq), dtype).flops
    except Exception:  # noqa: BLE001 - FLOPs are a bonus; latency and memory still stand
        return {}


def traced_cache_bytes(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, positions: int) -> int | None:
    """Bytes a decoding cache should hold after `positions` tokens: the keys and values per token the dataflow saw."""
    from dataclasses import replace

    from tblock_cli.params_report import param_report

    try:
        kv = param_report(subject, replace(cfg, seq=positions), dtype).kv_cache
    except Exception:  # noqa: BLE001 - the expected size is a bonus; the measured cache still stands
        return None
    return kv["bytes_per_token"] * cfg.batch * positions if kv else None


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


def check_sizes(cfg: BlockConfig, seqs: list[int], modes: list[str], device: torch.device, decode: int | None = None) -> None:
    """Refuse, before allocating anything, a sweep point estimated larger than the free memory."""
    for seq in seqs + ([seqs[0] + decode] if decode else []):
        est = runtime.bench_estimate(cfg, seq=seq, train="train" in modes)
        runtime.ensure_fits(est, device, f"bench at seq {seq}")


def run_bench(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *, seqs: list[int],
              modes: list[str], need_weights: bool, baseline: bool, min_time: float,
              progress: Callable[[str, int, int], None] | None = None, run: RunInfo | None = None,
              decode: int | None = None, breakdown: bool = False, compare_with: dict | None = None) -> BenchReport:
    started = time.perf_counter()
    points = plan(cfg, seqs, modes, need_weights, baseline) if modes else []
    if need_weights and not attention_modules(subject.module) and not hasattr(subject.module, "attentions"):
        raise ConfigError(f"--need-weights: {subject.name} has no nn.MultiheadAttention inside; need_weights is its option")
    trainable = any(p.requires_grad for p in subject.module.parameters())
    train_skipped = not trainable and "train" in modes and not has_gradient_path(subject, cfg, device, dtype, seqs[0])
    if train_skipped:
        points = [p for p in points if not (p[0] == "train" and p[3] == "block")]
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
                except USER_ERRORS as e:  # the block under test raised (sys.exit included)
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
    analytic, expected_from = None, "d_model"
    if decode:
        from tblock_cli.subject.kvcache import analytic_cache_bytes

        if progress:
            progress(f"decode {decode} tokens", len(points), total)
        results.extend(decode_results(subject, cfg, device, dtype, seqs[0], decode, clock))
        analytic = analytic_cache_bytes(cfg.layers, cfg.batch, seqs[0] + decode, cfg.d_model, dtype.itemsize)
        if not subject.builtin:  # a user or HF block's cache holds the key/value widths its projections give (GQA)
            traced = traced_cache_bytes(subject, cfg, dtype, seqs[0] + decode)
            analytic, expected_from = (traced, "trace") if traced else (analytic, "d_model")
    parts = []
    if breakdown:
        from tblock_cli.benchmark.breakdown import breakdown as run_breakdown

        for j, seq in enumerate(seqs):
            if progress:
                progress(f"breakdown seq {seq}", len(points) + (2 if decode else 0) + j, total)
            x = torch.randn(cfg.batch, seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
            try:
                parts.append(run_breakdown(subject, cfg, x, device, min_time, clock))
            except USER_ERRORS as e:
                reraise_as_measure_error(e, f"{subject.name} raised during --breakdown at seq {seq}")
    item = dtype.itemsize
    sizes = {s: {"weights_returned": cfg.batch * s * s * item, "matrix_per_head": cfg.batch * cfg.n_heads * s * s * item} for s in seqs}
    has_tel = any(isinstance(m, nn.TransformerEncoderLayer) for m in subject.module.modules())
    report = BenchReport(subject.name, tuple(results), sizes, cfg.batch, cfg.n_heads, cfg.dropout, runtime.environment(device, dtype),
                         has_tel, run, tuple(parts), None, analytic, sum(clock), time.perf_counter() - started,
                         trainable, train_skipped, expected_from)
    if compare_with is not None:
        from dataclasses import replace

        report = replace(report, comparisons=tuple(compare(report, compare_with)))
    return report


def has_gradient_path(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, seq: int) -> bool:
    """Whether a block without trainable parameters still has a backward: its output depends on its input differentiably."""
    x = torch.randn(cfg.batch, seq, cfg.d_model, generator=torch.Generator().manual_seed(cfg.seed))
    x = x.to(device=device, dtype=dtype).requires_grad_(True)
    module = subject.module
    was = module.training
    module.train(True)
    try:
        with torch.enable_grad():
            return bool(subject(x).requires_grad)
    except Exception as e:  # noqa: BLE001 - the block under test raised
        reraise_as_measure_error(e, f"{subject.name} raised in train mode at seq {seq}")
    finally:
        module.train(was)


def _decoded_shape(subject: Subject, y: torch.Tensor, x_t: torch.Tensor) -> None:
    """decode(x_t, cache) must give one output per new token, as the forward does (the check kv_cache asks the same)."""
    if tuple(y.shape) != tuple(x_t.shape):
        raise MeasureError(f"--decode: {subject.name}.decode returned outputs of shape {tuple(y.shape)} for new tokens of shape "
                           f"{tuple(x_t.shape)}; it must return (y_t, cache) with y_t shaped like x_t (see docs/decoding.md)")


def decode_results(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, prompt: int, n: int,
                   clock: list) -> list[BenchResult]:
    """Generate n tokens after a prompt: with the block's cache, and by recomputing the whole prefix each step."""
    from tblock_cli.subject import kvcache

    module = subject.module
    if not kvcache.has_decode(module):
        raise ConfigError(f"--decode: {subject.name} {kvcache.no_decode(module)}")
    sync = synchronizer(device)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch, prompt + n, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
    was = module.training
    module.eval()
    out = []
    try:
        with torch.inference_mode():
            y, cache = kvcache.decode_step(module, x[:, :prompt], None)  # warm-up
            _decoded_shape(subject, y, x[:, :prompt])
            _decoded_shape(subject, kvcache.decode_step(module, x[:, prompt : prompt + 1], cache)[0], x[:, prompt : prompt + 1])
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
    except USER_ERRORS as e:
        reraise_as_measure_error(e, f"{subject.name} raised while decoding")
    finally:
        module.train(was)
    return out

