"""What a block's code needs from this machine: CUDA-only constructors built on the device at hand, indices checked
on a CUDA device as the CPU checks them, and a missing optional dependency named with the command that installs it."""

from __future__ import annotations

import contextlib
import importlib.util

import torch
from torch.overrides import TorchFunctionMode

# Import names whose distribution is published under another name (pip install NAME).
PIP_NAMES = {"sklearn": "scikit-learn", "yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python",
             "flash_attn": "flash-attn", "attr": "attrs", "bs4": "beautifulsoup4"}


def is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, (str, int)) and not isinstance(device, bool) and \
        (isinstance(device, int) or device.split(":")[0] == "cuda")


class CudaElsewhere(TorchFunctionMode):
    """`.cuda()` and `device="cuda"` made on `target` instead: the calls `with torch.device(...)` cannot reach.

    `torch.device(...)` as a context is itself a TorchFunctionMode that fills in the device of factory calls; this one
    does the same for the explicit CUDA placements a constructor written for a GPU makes (Meta's llama builds its
    KV cache with `torch.zeros(...).cuda()`). It lives for the constructor's call only and patches nothing global, so
    it is the least surprising way to build such a block where CUDA is absent.
    """

    def __init__(self, target: torch.device):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(self.target)
        if is_cuda(kwargs.get("device")):
            kwargs["device"] = self.target
        if func is torch.Tensor.to and len(args) > 1 and is_cuda(args[1]):
            args = (args[0], self.target, *args[2:])
        return func(*args, **kwargs)


def on_this_machine():
    """A context for a user's constructor: without CUDA, its CUDA placements land on the default device (the CPU, or
    the meta device of a rebuild); with CUDA, nothing changes."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return CudaElsewhere(torch.get_default_device())


def missing_dependency(e: BaseException) -> str | None:
    """For an ImportError naming a module that is not installed: 'the module X ...: pip install NAME'; else None (a
    module that is installed but lacks a name, or an error of the user's own code)."""
    if not isinstance(e, ImportError) or not e.name:
        return None
    top = e.name.split(".")[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return f"needs the module {top!r}, which is not installed here: pip install {PIP_NAMES.get(top, top)}"


def _checked(index, size: int, dim: int, negative: bool, kind: type, what: str, on: tuple[str, ...]) -> None:
    """Raise what the CPU raises where an integer index on a device of the types `on` lies outside [-size or 0, size)."""
    if not isinstance(index, torch.Tensor) or index.device.type not in on or index.numel() == 0 \
            or index.is_floating_point() or index.dtype == torch.bool:
        return
    lo, hi = torch.stack(torch.aminmax(index.detach())).tolist()  # one synchronisation
    if hi >= size or lo < (-size if negative else 0):
        raise kind(what.format(index=hi if hi >= size else lo, dim=dim, size=size))


_BOUNDS = "index {index} is out of bounds for dimension {dim} with size {size}"
_RANGE = "index out of range in self"


def _index_list(args, on) -> None:
    """aten.index / index_put: a list of optional index tensors, one per dimension (a boolean mask takes its own)."""
    self, indices = args[0], args[1]
    dim = 0
    for idx in indices:
        if idx is not None and idx.dtype in (torch.bool, torch.uint8):
            dim += idx.dim()
            continue
        if idx is not None and dim < self.dim():
            _checked(idx, self.shape[dim], dim, True, IndexError, _BOUNDS, on)
        dim += 1


def _along(kind: type, what: str):
    """Ops of (self, dim, index, ...): gather, scatter, index_select, index_add, index_copy, index_fill."""
    def rule(args, on) -> None:
        self, dim, index = args[0], args[1], args[2]
        d = dim % max(self.dim(), 1)
        _checked(index, self.shape[d] if self.dim() else 1, d, False, kind, what, on)
    return rule


def indices_checked(on: tuple[str, ...] = ("cuda",)):
    """A dispatch mode that checks integer indices before an indexing op launches on a device of the types `on`,
    raising what the CPU raises.

    On the CPU an index out of range raises at the op, and tblock's probes read that as the block refusing an input (a
    sequence longer than its position table, a relative-bias table indexed past its distance). On a CUDA device it is a
    device-side assert: the CUDA context is lost and every later operation of the process fails, the report with it
    (measured on an H100: a relative-position block, hf:roberta). One synchronisation per indexing op, for the checks
    and the spec card only (bench does not run under it)."""
    from tblock_cli.runtime import dispatch_mode

    def handler(func, args, kwargs):
        rule = _RULES.get(func.overloadpacket)
        if rule is not None:
            rule(args, on)
        return func(*args, **kwargs)

    return dispatch_mode(handler)


_aten = torch.ops.aten
_RULES = {
    _aten.embedding: lambda a, on: _checked(a[1], a[0].shape[0], 0, False, IndexError, _RANGE, on),
    _aten.take: lambda a, on: _checked(a[1], a[0].numel(), 0, True, IndexError, "out of range: tried to access index "
                                       "{index} on a tensor of {size} elements", on),
    **{op: _index_list for op in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_)},
    **{op: _along(RuntimeError, _BOUNDS) for op in (_aten.gather, _aten.scatter, _aten.scatter_, _aten.scatter_add,
                                                   _aten.scatter_add_, _aten.scatter_reduce, _aten.scatter_reduce_)},
    **{op: _along(RuntimeError, _BOUNDS) for op in (_aten.index_add, _aten.index_add_)},
    **{op: _along(IndexError, _RANGE) for op in (_aten.index_select, _aten.index_copy, _aten.index_copy_, _aten.index_fill,
                                                _aten.index_fill_)},
}


def indexes_checked(device: torch.device):
    """indices_checked() where the work runs on a CUDA device; nothing elsewhere (the CPU checks its own indices)."""
    return indices_checked() if device.type == "cuda" else contextlib.nullcontext()
