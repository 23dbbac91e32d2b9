"""A device apart from the CPU, simulated on it, for tests: tensors that say they live on `simdev:0` (PyTorch's
PrivateUse1 backend registered from Python, renamed) and compute on the CPU. What it finds is what only a second
device shows: a tensor made on the host meeting the device's (`torch.empty(n)` indexed by a device tensor, scores
kept on the CPU compared with q and k on the device), which on a CUDA machine fails where the CPU passes. It finds no
numerical difference between devices: the arithmetic is the CPU's. Register it in a process of its own (the
registration is for the process's life).

    dev = registered()
    with simulated_device():
        card = read_card(subject, cfg, dev)
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

NAME = "simdev"  # the PrivateUse1 backend, renamed: a device apart from the CPU with a guard autograd can use


_LIB = []


def registered() -> torch.device:
    """The simulated device, registered once per process: PrivateUse1 as a Python backend whose allocations (the
    factories C++ code makes with a device tensor's options) are CPU tensors wrapped as OnDevice."""
    if getattr(torch, NAME, None) is None:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        lib = torch.library.Library("aten", "IMPL")
        _LIB.append(lib)

        def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
            return OnDevice(torch.empty(size, dtype=dtype, device="cpu"))

        def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
            return OnDevice(torch.empty_strided(size, stride, dtype=dtype, device="cpu"))

        def copy_from(src, dst, non_blocking=False):  # a copy between the host and the device made below Python
            inner = lambda t: t.elem if isinstance(t, OnDevice) else t  # noqa: E731
            inner(dst).copy_(inner(src))
            return dst

        lib.impl("_copy_from", copy_from, "PrivateUse1")
        lib.impl("empty.memory_format", empty, "PrivateUse1")
        lib.impl("empty_strided", empty_strided, "PrivateUse1")
    return torch.device(NAME, 0)


CPU = torch.device("cpu")
aten = torch.ops.aten
# Ops whose index tensors may stay on the host while the indexed tensor is on the device, as CUDA allows them to.
HOST_INDICES = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# Ops that move data between devices, or read one number off the device.
CROSSING = {aten.copy_.default, aten._to_copy.default, aten._local_scalar_dense.default, aten.lift_fresh.default}


def _is_simulated(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == NAME
    if isinstance(device, str):
        return device.split(":")[0] == NAME
    return isinstance(device, int) and not isinstance(device, bool)


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on the simulated device."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
                                                dtype=elem.dtype, layout=elem.layout, device=registered(),
                                                requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        host = []

        def unwrap(t):
            if isinstance(t, OnDevice):
                return t.elem
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0:
                host.append(t)
            return t

        plain_args = tree_map(unwrap, args)
        indices = args[1] if func in HOST_INDICES and len(args) > 1 else ()
        hosted = [t for t in host if not any(t is i for i in (indices or ()) if isinstance(i, torch.Tensor))]
        if hosted and func not in CROSSING:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, simdev:0 "
                               f"and cpu! ({func})")
        plain_kwargs = tree_map(unwrap, kwargs)
        to_host = func is aten._to_copy.default and kwargs.get("device") is not None and not _is_simulated(kwargs["device"])
        if _is_simulated(plain_kwargs.get("device")):
            plain_kwargs["device"] = CPU
        out = func(*plain_args, **plain_kwargs)
        if func is aten.copy_.default:  # in place into the device tensor: the wrapper is the result
            return args[0]
        if to_host:
            return out
        # lazy conjugate/negative bits resolved: a wrapper does not carry them, and its elem would apply them twice
        return tree_map(lambda t: OnDevice(t.resolve_conj().resolve_neg()) if isinstance(t, torch.Tensor)
                        and not isinstance(t, OnDevice) else t, out)


def _device_of(args, kwargs):
    """The device a call asks for (a `device=` keyword, `.to(device)`, `.to(tensor)`), or None."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class Placements(TorchFunctionMode):
    """Factory calls and moves to the simulated device land on the CPU, wrapped as OnDevice; moves of OnDevice to the
    CPU unwrap."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.untyped_storage) and isinstance(args[0], OnDevice):
            return func(args[0].elem)
        if func is torch.Tensor.to:
            target, t = _device_of(args, kwargs), args[0]
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            if dtype is None and args[1:] and isinstance(args[1], torch.Tensor):
                dtype = args[1].dtype
            if target is not None and _is_simulated(target) and not isinstance(t, OnDevice):
                moved = t.to(dtype) if dtype is not None else t
                return OnDevice(moved if moved.requires_grad else moved.detach())
            if target is not None and not _is_simulated(target) and isinstance(t, OnDevice):
                return t.elem.to(dtype) if dtype is not None else t.elem
        if _is_simulated(kwargs.get("device")):
            kwargs["device"] = CPU
            out = func(*args, **kwargs)
            return OnDevice(out) if isinstance(out, torch.Tensor) and not isinstance(out, OnDevice) else out
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_device():
    """Placements onto the simulated device land on the CPU, wrapped (OnDevice); modules move by swapping their
    tensors (assigning `.data` of a wrapper would keep its old values)."""
    registered()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with Placements():
            yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
