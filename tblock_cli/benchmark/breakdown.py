"""Where one forward's time and memory go: attention projections, the attention kernel, FFN, norms, residual adds.

Each torch function the forward calls is timed (synchronised on CUDA) and filed under a component by
what it does: a projection by its dataflow role, SDPA and softmax products as the kernel, a token norm
as a norm, an add of two (B, T, d) tensors as a residual add. nn.MultiheadAttention's one opaque
function call is run decomposed (projections, SDPA or softmax(QK^T)V, output projection) so its parts
can be timed apart. Memory per component comes from one profiled forward: the largest rise of tensor
memory inside any of that component's calls.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tblock_cli.anatomy.mha import MHACall
from tblock_cli.anatomy.ops import ACTIVATIONS, ADDS, MATMULS, NORMS, PROJECTIONS, QUIET, SOFTMAX

COMPONENTS = ("attention projections", "attention kernel", "FFN", "norms", "residual adds", "other")
# The attention kernel: SDPA, or a softmax and the products around it.
KERNEL_FUNCS = {"scaled_dot_product_attention"} | SOFTMAX | MATMULS
# A forward is clocked this many times at least; the per-component medians are taken over them.
MIN_RUNS = 3


class _Clock(TorchFunctionMode):
    """Times each torch call of a forward and files it under a component."""

    def __init__(self, weight_group: dict[int, str], d_model: int, sync, label: bool):
        super().__init__()
        self.weight_group, self.d, self.sync, self.label = weight_group, d_model, sync, label
        self.times: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.inside: list[str] = []  # component of an enclosing module (a norm module): its ops are not split

    def timed(self, component: str, fn, *args, **kwargs):
        from torch.autograd.profiler import record_function

        self.sync()
        t0 = time.perf_counter()
        with record_function(f"tblock::{component}") if self.label else nullcontext():
            out = fn(*args, **kwargs)
        self.sync()
        self.times[component] += time.perf_counter() - t0
        self.calls[component] += 1
        return out

    def component(self, func, name, args, kwargs) -> str:
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        group = next((self.weight_group[id(t)] for t in tensors if id(t) in self.weight_group), None)
        if name in PROJECTIONS and group is not None:
            return {"attention": "attention projections", "ffn": "FFN"}.get(group, "other")
        if name in KERNEL_FUNCS:
            return "attention kernel"
        if name in NORMS:
            return "norms"
        if name in ACTIVATIONS:
            return "FFN"
        if name in ADDS and len(tensors) == 2 and tensors[0].shape == tensors[1].shape and tensors[0].shape[-1:] == (self.d,):
            return "residual adds"
        return "other"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in QUIET or self.inside:
            return func(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return self.mha(args, kwargs) or self.timed("attention kernel", func, *args, **kwargs)
        return self.timed(self.component(func, name, args, kwargs), func, *args, **kwargs)

    def mha(self, args, kwargs):
        """nn.MultiheadAttention's call, decomposed: q/k/v projections, SDPA (or softmax weights), output projection."""
        call = MHACall.of(args, kwargs)
        if not call.plain or not call.batched:
            return None  # rare options: timed whole, as the kernel
        q, k, v = call["query"], call["key"], call["value"]  # (L, N, E)
        L, N, E = q.shape
        S, H = k.shape[0], call.heads
        dh = E // H
        (wq, wk, wv), (bq, bk, bv) = call.weights(), call.biases()
        proj = "attention projections"
        q = self.timed(proj, F.linear, q, wq, bq).view(L, N, H, dh).permute(1, 2, 0, 3)  # (N, H, L, dh)
        k = self.timed(proj, F.linear, k, wk, bk).view(S, N, H, dh).permute(1, 2, 0, 3)
        v = self.timed(proj, F.linear, v, wv, bv).view(S, N, H, dh).permute(1, 2, 0, 3)
        mask = call.additive(N, L, S, q.device, q.dtype)  # (N or 1, H or 1, L, S)
        kernel = "attention kernel"
        weights = None
        if call["need_weights"]:
            def weighted():
                s = q @ k.transpose(-2, -1) / math.sqrt(dh)
                w = (s if mask is None else s + mask).softmax(-1)
                return w @ v, w
            y, w = self.timed(kernel, weighted)
            weights = w.mean(1) if call["average_attn_weights"] else w
        else:
            y = self.timed(kernel, F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
        y = y.permute(2, 0, 1, 3).reshape(L, N, E)
        return self.timed(proj, F.linear, y, call["out_proj_weight"], call["out_proj_bias"]), weights


def weight_groups(module: nn.Module, flow) -> dict[int, str]:
    """id(weight matrix) -> the dataflow group of the module owning it."""
    group = {m.name: m.group for m in flow.modules}
    out = {}
    for name, m in module.named_modules():
        for p in m.parameters(recurse=False):
            if p.ndim >= 2:
                out[id(p)] = "attention" if isinstance(m, nn.MultiheadAttention) else group.get(name, "other")
    return out


def breakdown(subject, cfg, x: torch.Tensor, device: torch.device, min_time: float, clock: list):
    """Per-component time of an eval forward (no_grad, MHA fast path off), and the whole forward's time."""
    from tblock_cli.anatomy import trace
    from tblock_cli.benchmark.report import Breakdown
    from tblock_cli.benchmark.timing import synchronizer, time_samples
    from tblock_cli.probes import train_mode

    module = subject.module
    flow = trace(module, subject, x, cfg.d_model)
    groups = weight_groups(module, flow)
    sync = synchronizer(device)
    norms = flow.norms
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused path would hide projections and kernel in one call
    try:
        with train_mode(module, False), torch.no_grad():
            def plain():
                subject(x)
            plain()
            whole = time_samples(plain, device, min_time, clock)
            runs, spent = [], 0.0
            while len(runs) < MIN_RUNS or spent < min_time:
                c = _Clock(groups, cfg.d_model, sync, label=False)
                t0 = time.perf_counter()
                with _norm_hooks(module, norms, c):
                    with c:
                        subject(x)
                spent += time.perf_counter() - t0
                runs.append(c)
            peaks = _component_peaks(subject, x, module, norms, groups, cfg.d_model, sync) if device.type == "cpu" else {}
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    parts = []
    for comp in COMPONENTS:
        t = statistics.median(r.times.get(comp, 0.0) for r in runs)
        calls = runs[0].calls.get(comp, 0)
        if t > 0 or calls:
            parts.append((comp, t, peaks.get(comp, -1), calls))
    return Breakdown(x.shape[1], tuple(parts), whole, "eval forward, no_grad, MHA fast path off; each call synchronised and timed")


class _norm_hooks:
    """Time a norm module's whole call as 'norms' (its ops inside are not split out)."""

    def __init__(self, module, norms, clock):
        self.module, self.norms, self.clock, self.handles = module, norms, clock, []

    def __enter__(self):
        from torch.autograd.profiler import record_function

        starts = []

        def pre(_m, _a):
            self.clock.sync()
            rf = record_function("tblock::norms") if self.clock.label else None
            if rf is not None:
                rf.__enter__()
            starts.append((time.perf_counter(), rf))
            self.clock.inside.append("norms")

        def post(_m, _a, _o):
            self.clock.sync()
            t0, rf = starts.pop()
            if rf is not None:
                rf.__exit__(None, None, None)
            self.clock.inside.pop()
            self.clock.times["norms"] += time.perf_counter() - t0
            self.clock.calls["norms"] += 1

        for name, m in self.module.named_modules():
            if name in self.norms and not isinstance(m, nn.LayerNorm):
                self.handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _component_peaks(subject, x, module, norms, groups, d_model, sync) -> dict[str, int]:
    """The largest rise of tensor memory inside any one call of each component, from one profiled forward."""
    from tblock_cli.benchmark.profiling import _kineto_events, _quiet_stderr, cpu_profiler

    c = _Clock(groups, d_model, sync, label=True)
    with _quiet_stderr(), cpu_profiler(memory=True) as prof:
        with _norm_hooks(module, norms, c):
            with c:
                subject(x)
    events = _kineto_events(prof)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = [(e.name().removeprefix("tblock::"), e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("tblock::")]
    peaks: dict[str, int] = {}
    for comp, start, end in ranges:
        running = before = peak = 0
        for t, nbytes in mem:
            if t > end:
                break
            running += nbytes
            if t < start:
                before = running
                peak = running
            else:
                peak = max(peak, running)
        peaks[comp] = max(peaks.get(comp, 0), peak - before)
    return peaks

