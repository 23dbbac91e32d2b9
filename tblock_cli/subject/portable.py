"""What a block's code needs from this machine: CUDA-only constructors built on the device at hand, and a missing
optional dependency named with the command that installs it."""

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
