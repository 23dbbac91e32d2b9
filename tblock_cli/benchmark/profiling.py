"""What one call allocates at its peak and which operators it ran, read from PyTorch's own counters."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from tblock_cli.errors import STDERR_FD


@dataclass(frozen=True)
class CallProfile:
    peak_bytes: int  # the most tensor memory the call held at once, above what existed before it
    ops: frozenset[str]  # aten operator names it ran
    source: str  # where peak_bytes came from


@contextmanager
def _quiet_stderr():
    """The profiler writes `USDT: ... profiler_start/stop` lines straight to fd 2: keep them out."""
    try:
        fd = os.dup(2)
    except OSError:  # no real stderr (some test runners): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    STDERR_FD[0] = fd  # a Ctrl-C in the window still says "interrupted" where the user sees it
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(fd, 2)
        STDERR_FD[0] = 2
        os.close(fd)
        os.close(devnull)


def cpu_profiler(memory: bool):
    """PyTorch's profiler recording CPU operators (and, with memory, CPU allocation events).

    The autograd profiler that torch.profiler.profile drives, used directly: torch.profiler.profile's start asks
    hasattr(torch, "_inductor"), which imports inductor, dynamo and sympy (~5 s on a process's first profile)."""
    from torch.autograd.profiler import profile

    return profile(use_cpu=True, use_kineto=True, profile_memory=memory)


def _kineto_events(prof) -> list:
    """The profiler's raw events; a semi-private API, so fail loudly if it moves."""
    try:
        return list(prof.kineto_results.events())
    except AttributeError as e:  # pragma: no cover - depends on the torch version
        raise RuntimeError(
            f"this torch ({torch.__version__}) no longer exposes profiler.kineto_results.events(); "
            "tblock cannot read CPU memory events"
        ) from e


def peak_from_memory_events(events: list) -> int:
    """Running sum of [memory] events (+alloc, -free) in time order; its maximum is the peak."""
    mem = sorted(
        ((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")),
        key=lambda t: t[0],
    )
    running = peak = 0
    for _, nbytes in mem:
        running += nbytes
        peak = max(peak, running)
    return peak


def profile_call(fn: Callable[[], object], device: torch.device) -> CallProfile:
    """Run fn once under the profiler: operator names, and the peak of the tensor memory it held.

    CPU: from the profiler's memory events. CUDA: torch.cuda's peak statistic after a synchronised
    run (above what was allocated before), with operator names from a second, profiled run.
    """
    cpu = device.type == "cpu"
    with _quiet_stderr(), cpu_profiler(memory=cpu) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = _kineto_events(prof)
    ops = frozenset(e.name() for e in events if e.name().startswith("aten::"))
    if cpu:
        return CallProfile(peak_from_memory_events(events), ops, "profiler memory events")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return CallProfile(torch.cuda.max_memory_allocated(device) - base, ops, "torch.cuda.max_memory_allocated")
    return CallProfile(-1, ops, f"not measured on {device.type}")


# Operator -> (what the kernel is, whether it materialises the (L, S) attention matrix).
# Checked in this order: a fused SDPA kernel inside the native fast path is named by the kernel.
KERNELS: tuple[tuple[str, str, bool], ...] = (
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "SDPA flash-cpu", False),
    ("aten::_scaled_dot_product_flash_attention", "SDPA flash", False),
    ("aten::_scaled_dot_product_efficient_attention", "SDPA mem-efficient", False),
    ("aten::_scaled_dot_product_cudnn_attention", "SDPA cuDNN", False),
    ("aten::_scaled_dot_product_fused_attention_overrideable", "SDPA fused", False),
    ("aten::_efficient_attention_forward", "SDPA mem-efficient", False),
    ("aten::_flash_attention_forward", "SDPA flash", False),
    ("aten::_scaled_dot_product_attention_math", "SDPA math", True),
)
FAST_PATH = "aten::_native_multi_head_attention"
ENCODER_FAST_PATH = "aten::_transformer_encoder_layer_fwd"


def attention_kernel(ops: frozenset[str]) -> tuple[str, bool]:
    """Name the attention kernel that ran, and whether it materialised the attention matrix."""
    prefix = ""
    if ENCODER_FAST_PATH in ops:
        prefix = "TEL fastpath "
    elif FAST_PATH in ops:
        prefix = "fastpath "
    for op, label, materialises in KERNELS:
        if op in ops:
            return prefix + label, materialises
    if "aten::_softmax" in ops and ({"aten::bmm", "aten::baddbmm"} & ops):
        return prefix + "bmm+softmax", True
    return (prefix.strip() or "none seen"), bool(prefix)
