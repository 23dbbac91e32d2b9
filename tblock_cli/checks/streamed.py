"""The float64 reference streamed sublayer by sublayer: each unit computes in float64 on copies of its own tensors,
made just before it runs and dropped after (the dtype check's reference without a whole float64 copy)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

# Units whose forward keeps no view of its weights (a new tensor out, nothing stored): their float64 copies share one
# reused buffer. Exact types: a subclass may override forward.
POOLED_UNITS = (nn.Linear, nn.Embedding)
# A module whose parameters and buffers take more than this is not cast whole: its children are, each
# while it runs. 64 MiB keeps the float64 copies alive at once to about one sublayer's matrices.
STREAM_UNIT_BYTES = 64 * 1024**2


def _float_tensors(module: nn.Module, recurse: bool):
    return [(m, k, t) for m in (module.modules() if recurse else [module])
            for table in (m._parameters, m._buffers) for k, t in table.items()
            if t is not None and t.is_floating_point()]


def stream_units(module: nn.Module) -> list[nn.Module]:
    """The modules cast to float64 as wholes: a module small enough, with tensors of its own (a parent may read
    them with its children's: nn.MultiheadAttention reads out_proj.weight), or without children; else its children."""
    size = sum(t.numel() * 8 for _, _, t in _float_tensors(module, True))
    children = list(module.children())
    if size <= STREAM_UNIT_BYTES or _float_tensors(module, False) or not children:
        return [module]
    return [u for c in children for u in stream_units(c)]


@contextmanager
def float64_streamed(module: nn.Module, device: torch.device):
    """The module computing in float64 without a float64 copy of it all: each unit (stream_units) gets float64
    copies of its tensors just before it runs, and its own back when it returns. The float64 copy of a 7B-size
    layer is 1.6 GB; this holds one sublayer's at a time. Everything is restored on exit, whatever happened.
    A unit whose tensors are read where it is not called (a parent reading a child's weight) fails to run in
    mixed dtypes: the caller then falls back to a whole copy."""
    originals: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor]] = {}
    # One float64 buffer, the largest such unit's size, that nn.Linear and nn.Embedding units' copies are laid into one
    # unit at a time: memory already written is 10x faster to write again than fresh pages (0.04 vs 0.1-0.4 s for a
    # 4096 x 11008 matrix). Their forwards keep no view of their weights, so the next unit may overwrite them; any
    # other unit (its forward may return or keep a view: a position table's slice) gets copies of its own.
    units = stream_units(module)
    pooled = {id(u) for u in units if type(u) in POOLED_UNITS}
    size = max((sum(t.numel() for _, _, t in _float_tensors(u, True)) for u in units if id(u) in pooled), default=0)
    pool: list[torch.Tensor] = []

    def cast(unit, *_):
        if id(unit) in pooled and not pool:
            pool.append(torch.empty(size, dtype=torch.float64, device=device))
        start = 0
        for m, k, t in _float_tensors(unit, True):
            if (id(m), k) in originals:
                continue
            originals[(id(m), k)] = (m, k, t)
            if id(unit) in pooled:
                copy = pool[0][start : start + t.numel()].view(t.shape).copy_(t.detach())
                start += t.numel()
            else:
                copy = t.detach().to(device=device, dtype=torch.float64)
            table = m._parameters if k in m._parameters else m._buffers
            table[k] = nn.Parameter(copy, requires_grad=False) if isinstance(t, nn.Parameter) else copy

    def restore(unit, *_):
        for m, k, _t in _float_tensors(unit, True):
            saved = originals.pop((id(m), k), None)
            if saved is not None:
                table = m._parameters if k in m._parameters else m._buffers
                table[k] = saved[2]

    hooks = []
    try:
        for unit in units:
            hooks.append(unit.register_forward_pre_hook(cast))
            hooks.append(unit.register_forward_hook(restore, always_call=True))
        yield module
    finally:
        for h in hooks:
            h.remove()
        for m, k, t in originals.values():
            (m._parameters if k in m._parameters else m._buffers)[k] = t
