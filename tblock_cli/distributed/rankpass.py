"""What a rank does for both comparisons: the same weights everywhere, one forward + backward, module outputs, max over ranks."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.probes import rel_diff, train_mode


@dataclass
class Pass:
    """One eval-mode forward + backward of (out * v).sum(): what the comparisons compare."""

    out: torch.Tensor
    x_grad: torch.Tensor | None
    grads: dict  # parameter name -> full gradient (a DTensor's full_tensor()), None when it got none
    outputs: list  # (module name, its first output tensor, local to this rank), in the order modules finished


def same_weights(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy on this rank's device holding rank 0's parameters and buffers."""
    import torch.distributed as dist

    module = copy.deepcopy(module).to(device)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)
    return module


def inputs(seed: int, shape: tuple, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x and the output's random projection v, the same on every rank (one seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for _ in range(2))


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@contextmanager
def module_outputs(module: nn.Module):
    """Each submodule's first output (first call only), and the innermost module running if the forward raises."""
    outputs, running, hooks = {}, [], []

    def enter(name):
        return lambda _m, _a: running.append(name)

    def leave(name):
        def hook(_m, _a, out):
            running.pop()
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(t, torch.Tensor) and name not in outputs:
                outputs[name] = local(t).detach().clone()
        return hook

    for name, m in module.named_modules():
        if name:
            hooks += [m.register_forward_pre_hook(enter(name)), m.register_forward_hook(leave(name))]
    try:
        yield outputs
    except Exception as e:
        e.tblock_where = running[-1] if running else None
        raise
    finally:
        for h in hooks:
            h.remove()


def forward_backward(subject, x: torch.Tensor, v: torch.Tensor) -> Pass:
    """Eval mode (no dropout) with gradients on; x's gradient and every parameter's, made full."""
    module = subject.module
    x = x.detach().clone().requires_grad_(True)
    with train_mode(module, False), torch.enable_grad(), module_outputs(module) as outputs:
        out = full(subject(x, None))
        (out.float() * v.float()).sum().backward()
    grads = {name: None if p.grad is None else full(p.grad).detach() for name, p in module.named_parameters()}
    return Pass(out.detach(), x.grad, grads, list(outputs.items()))


def diff_local(got: torch.Tensor, ref: torch.Tensor, rank: int, n: int) -> float | None:
    """A module output against the unsharded one: whole, or this rank's chunk of the one dimension that is n times
    smaller here (a column-sharded projection, or heads split from it); None when the layouts cannot be matched."""
    if got.shape == ref.shape:
        return rel_diff(got, ref)
    if got.ndim != ref.ndim:
        return None
    split = [d for d in range(got.ndim) if got.shape[d] != ref.shape[d]]
    if len(split) == 1 and got.shape[split[0]] * n == ref.shape[split[0]]:
        return rel_diff(got, ref.chunk(n, dim=split[0])[rank])
    return None


def grad_diffs(got: dict, ref: dict, scale: float = 1.0) -> dict:
    """name -> relative difference of full gradients (inf when one side has none)."""
    out = {}
    for name, g in ref.items():
        mine = got.get(name)
        if g is None and mine is None:
            continue
        out[name] = float("inf") if g is None or mine is None else rel_diff(mine, g * scale)
    return out


def world_max(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def world_min(value: int, device: torch.device) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
