"""Stop-gradients on parameters alone: a `.detach()` of a tensor computed from the block's parameters and no input
(DoRA's weight norm, a quantiser's scale taken from the weights) is an approximation a design documents, where one
on the data's path (a norm's statistics) changes the gradient of every step. The derivative check asks what autograd
gives with the former undone, to tell the two apart."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from tblock_cli.checks.graphs import reaches

# Nodes walked from a detached tensor looking for the input; a walk that stops here counts as reaching it (the
# tensor is then the data's, and its detach left alone)
WALK_LIMIT = 2000


class Undetached(TorchFunctionMode):
    """`detach()` of a tensor with a graph that no path from `inputs` reaches, returned as a copy that keeps the graph
    (counted in `undone`); every other call as it is."""

    def __init__(self, inputs: set[int]):
        super().__init__()
        self.inputs, self.undone = inputs, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.detach, torch.detach) and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if t.grad_fn is not None and not reaches(t.grad_fn, self.inputs, WALK_LIMIT, truncated=True):
                self.undone += 1
                return t.clone()
        return func(*args, **kwargs)


def undetached_grads(call, x: torch.Tensor, w: torch.Tensor,
                     params: list) -> tuple[torch.Tensor, list[torch.Tensor], int] | None:
    """Autograd's gradients of (call(x) * w).sum() at the input and each of params, with every stop-gradient on
    parameters alone undone (in the caller's seed and mode), and how many were; None where the forward detaches
    none."""
    with torch.enable_grad():
        xr = x.clone().requires_grad_(True)
        mode = Undetached({id(xr)})
        for _, p in params:
            p.grad = None
        with mode:
            out = call(xr)
        if not mode.undone:
            return None
        (out * w).sum().backward()
    gx = xr.grad if xr.grad is not None else torch.zeros_like(x)
    return gx, [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params], mode.undone
