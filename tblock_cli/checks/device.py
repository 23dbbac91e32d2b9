"""The device check: would the block run on a GPU? Asked on a machine without one.

A tensor a forward creates without `device=` (`torch.arange(T)`, `torch.ones(T, T).tril()`, `torch.rand(x.shape)`
for a mask) lands on the CPU. On the CPU nothing shows; on a GPU the first operation that meets such a tensor with
the block's own raises ("Expected all tensors to be on the same device"). The check runs the block on the CPU with real values
and keeps, for every tensor, the side it would be on had the block been moved to a GPU with `.to()`:

- the device's side: the input, whatever `.to()` moves (parameters, buffers, what a module's own `_apply` moves),
  tensors created with `device=` or by `.to(device)`, `x.new_*`, and everything computed from one of them;
- the host's: tensors created without `device=` in the forward, and what is computed from those alone.

At every operation CUDA's rule applies: a host tensor of one or more dimensions meets the device's tensors only
where CUDA allows it (indices of an indexing, a copy between devices); a 0-dim host tensor is a scalar CUDA takes
anywhere. Code that reads a host tensor's `.device` is taken to move it where it belongs (on a GPU that test would
differ), so that tensor is no longer judged."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, passed, skipped, warned
from tblock_cli.checks.training import seeded, too_large
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import train_mode
from tblock_cli.runtime import dispatch_mode

DEVICE, HOST = "device", "host"
_aten = torch.ops.aten
# Operations CUDA runs with host tensors among their arguments: indices of an indexing (moved by the kernel), a copy
# or a conversion between devices. Their result is on the side of their first argument.
_MIXED_ALLOWED = frozenset({
    _aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_, _aten._unsafe_index, _aten._unsafe_index_put,
    _aten.copy, _aten.copy_, _aten._to_copy, _aten._foreach_copy, _aten._foreach_copy_, _aten.lift_fresh,
    _aten.lift_fresh_copy, _aten.set_, _aten._has_compatible_shallow_copy_type,
})
# torch's functions that create a tensor from sizes or data: on the host unless given a device.
_FACTORIES = frozenset({
    torch.arange, torch.range, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.tensor, torch.eye, torch.linspace, torch.logspace, torch.tril_indices, torch.triu_indices,
    torch.empty_strided, torch.scalar_tensor, torch.from_numpy, torch.as_tensor, torch.normal,
})
# Reading these of a host tensor is code that knows where it is (`if t.device != x.device: t = t.to(x.device)`).
_WHERE = frozenset({torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.get_device})


class DeviceMismatch(RuntimeError):
    """An operation meeting the device's tensors with host tensors of one or more dimensions, as CUDA refuses it."""


class Sides:
    """Which side each tensor would be on (DEVICE, HOST; absent: not known) and the first mismatch seen."""

    def __init__(self):
        self.side = WeakTensorKeyDictionary()
        self.first: dict | None = None

    def of(self, t: torch.Tensor) -> str | None:
        return self.side.get(t)

    def put(self, result, side: str | None) -> None:
        if side is not None:
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.side[t] = side

    def on_op(self, func, args: tuple, kwargs: dict):
        """The dispatch rule: CUDA's device rule at every aten op, and the side of its result."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sides = [self.of(t) for t in tensors]
        if func.overloadpacket in _MIXED_ALLOWED:
            side = sides[0] if sides else None
        else:
            host = [tuple(t.shape) for t, s in zip(tensors, sides) if s == HOST and t.dim() > 0]
            if DEVICE in sides and host:
                if self.first is None:
                    self.first = {"op": func.overloadpacket.__name__, "host_shapes": [list(s) for s in host]}
                raise DeviceMismatch(f"Expected all tensors to be on the same device ({func.overloadpacket.__name__} "
                                     f"meets host tensors of shape {host})")
            side = DEVICE if DEVICE in sides else HOST if HOST in sides else None
        out = func(*args, **kwargs)
        self.put(out, side)
        return out


class HostFactories(TorchFunctionMode):
    """Puts on the host what torch's factories create without a device, on the device's side what `.to(device)`,
    `x.new_*` and factories given a device create; forgets a host tensor whose device the code reads."""

    def __init__(self, sides: Sides):
        super().__init__()
        self.sides = sides

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WHERE:
            if args and isinstance(args[0], torch.Tensor) and self.sides.of(args[0]) == HOST:
                del self.sides.side[args[0]]
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in _FACTORIES:
            if not (func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)):
                self.sides.put(out, DEVICE if kwargs.get("device") is not None else HOST)
        elif func in (torch.Tensor.to, torch.Tensor.type_as) and _names_a_device(args[1:], kwargs):
            if isinstance(out, torch.Tensor) and self.sides.of(out) != DEVICE:
                out = out.clone() if out is args[0] else out  # on a GPU a copy, the host tensor staying behind
                self.sides.put(out, DEVICE)
        elif getattr(func, "__name__", "").startswith("new_") and args and isinstance(args[0], torch.Tensor):
            self.sides.put(out, self.sides.of(args[0]))
        return out


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether Tensor.to / type_as arguments say where to: a device, a device's name, or another tensor."""
    if kwargs.get("device") is not None:
        return True
    for a in args:
        if isinstance(a, (torch.device, torch.Tensor)):
            return True
        if isinstance(a, str):
            try:
                torch.device(a)
                return True
            except RuntimeError:
                pass
    return False


def device_sides(module: nn.Module, sides: Sides) -> None:
    """Marks what `.to()` would move as the device's: each tensor the module's `_apply` hands over (parameters,
    buffers, and what a module's own `_apply` moves). Plain tensor attributes stay unknown: a cache a model sets up
    after it was moved (gpt-fast's `setup_caches` under `torch.device(...)`) is made on the device; one left behind
    by `.to()` is the `state_dict` check's warning."""
    def mark(t: torch.Tensor) -> torch.Tensor:
        sides.side[t] = DEVICE
        return t

    module._apply(mark)


def check_device(ctx: Context) -> Outcome:
    """Catches: a training forward and backward that would raise on a GPU (a **warning**: what runs here computes what
    it should): a tensor created on the CPU inside the forward (no `device=`: `torch.arange(T)`, `torch.ones(T,
    T).tril()`, `torch.rand(x.shape)` for a dropout mask) meeting the block's own tensors; seen on the CPU by following
    which tensors `.to(device)` would move and applying CUDA's device rule at every operation; names the operation"""
    if ctx.device.type != "cpu":
        return skipped("device.on_accelerator", device=str(ctx.device))
    large = too_large(ctx)
    if large is not None:
        return large
    module = ctx.subject.module
    sides = Sides()
    ctx.step("training forward and backward, tensors followed")
    try:
        device_sides(module, sides)
        x = ctx.x()
        sides.side[x] = DEVICE
        with seeded(ctx.device), train_mode(module, True), HostFactories(sides), dispatch_mode(sides.on_op):
            out = ctx.subject(x)
            if out.requires_grad:
                out.float().sum().backward()
    except Exception as e:  # noqa: BLE001 - a mismatch is read from `sides`; anything else is the block's own error
        if is_out_of_memory(e):
            raise
        if sides.first is None:
            return skipped("device.not_traced", error=one_line(e))
    finally:
        for p in module.parameters():
            p.grad = None
    if sides.first is not None:
        return warned("device.mismatch", sides.first["op"], **sides.first)
    return passed("device.portable")
