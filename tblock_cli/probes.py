"""Probe helpers shared by checks, depth and anatomy: float64 comparisons, train/eval switching, residual gain."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

# tr(J)/n is estimated from this many Rademacher probes (std ~ 1/sqrt(n) per probe).
RESIDUAL_PROBES = 8


@contextmanager
def kept_modes(module: nn.Module):
    """Every submodule's training flag as it was, after (a frozen BatchNorm in eval inside a training model stays so)."""
    was = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for m, training in was:
            m.training = training


@contextmanager
def train_mode(module: nn.Module, on: bool):
    """Put the module in train (on) or eval mode for a while; restore what each part was."""
    with kept_modes(module):
        module.train(on)
        yield


def f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy on the CPU, where every comparison is made (MPS has no float64)."""
    return t.detach().to(device="cpu", dtype=torch.float64)


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max|a - ref| / max(1, max|ref|), in float64; inf if either is not finite."""
    a, ref = f64(a), f64(ref)
    if not (torch.isfinite(a).all() and torch.isfinite(ref).all()):
        return float("inf")
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (a - ref).abs().max().item() / scale if a.numel() else 0.0


def residual_gain(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, gen: torch.Generator,
                  probes: int = RESIDUAL_PROBES) -> float:
    """tr(J)/n of x -> f(x), from Rademacher probes v: E[v . (J^T v)] = tr(J)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = f(x.clone())
        if out.shape != x.shape:
            raise ValueError(f"output shape {tuple(out.shape)} differs from the input's {tuple(x.shape)}")
        total = 0.0
        for k in range(probes):
            v = (torch.randint(0, 2, out.shape, generator=gen) * 2 - 1).to(device=out.device, dtype=out.dtype)
            (g,) = torch.autograd.grad(out, x, v, retain_graph=k < probes - 1, allow_unused=True)
            if g is None:
                return 0.0
            total += (f64(v) * f64(g)).sum().item()
    return total / probes / x.numel()
