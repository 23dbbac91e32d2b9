"""What the spec readers draw on: a float64 copy of the block in eval mode, seeded inputs, and one capture of every
torch call a forward makes (name, tensors in, tensor out, the module it ran in), so each reader reads its own numbers
off the dataflow instead of off names or source text."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tblock_cli.config import BlockConfig
from tblock_cli.probes import cast, module_copy, train_mode


@dataclass(frozen=True)
class Call:
    """One torch call seen during a captured forward; tensors are float64 copies taken when it returned."""

    name: str  # the function's __name__: linear, scaled_dot_product_attention, softmax, __matmul__, layer_norm, ...
    func: object
    args: tuple  # positional arguments, tensors copied
    kwargs: dict
    out: object  # the output (a tensor, or a tuple of them), copied
    module: str  # the qualified name of the innermost module running, "" for the root
    weight: str | None = None  # for linear (and x @ W): the qualified name of the weight parameter (W, W.T, W[e])

    def tensor_args(self) -> list[torch.Tensor]:
        return [a for a in list(self.args) + list(self.kwargs.values()) if isinstance(a, torch.Tensor)]


def _copy(obj):
    if isinstance(obj, nn.Parameter):  # a forward does not change its parameters; stacked experts' (E, f, d) weights,
        return obj  # indexed once per expert, cost 4 of 6 s to copy at each index on deepseek_v3's 256 experts
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(o) for o in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    return obj


class Capture(TorchFunctionMode):
    """Records every torch function call of one forward (calls made inside another recorded call are not seen:
    nn.MultiheadAttention is one call, `multi_head_attention_forward`)."""

    SKIP = frozenset({"__get__", "__set__", "size", "dim", "__len__", "is_floating_point", "__bool__", "item",
                      "__format__", "__repr__", "numel", "is_contiguous", "stride", "data_ptr", "__hash__", "__index__"})

    def __init__(self, module: nn.Module):
        super().__init__()
        self.calls: list[Call] = []
        self.stack: list[str] = [""]
        self.weights = {id(p): n for n, p in module.named_parameters()}
        self._params = list(module.named_parameters())
        self._storage: dict | None = None  # storage -> name of the stacked (3-D) weights, built on first need
        self.names = {id(p): n for n, p in list(module.named_parameters()) + list(module.named_buffers())}
        self._hooks = []
        for name, m in module.named_modules():
            self._hooks.append(m.register_forward_pre_hook(lambda _m, _a, n=name: self.stack.append(n)))
            self._hooks.append(m.register_forward_hook(lambda _m, _a, _o: self._leave()))

    def _leave(self) -> None:  # a forward hook that returned a value would replace the module's output
        if len(self.stack) > 1:
            self.stack.pop()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in self.SKIP:
            return out
        weight = None
        if name in ("linear", "matmul", "__matmul__", "bmm") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            weight = self.weight_name(args[1])
        elif name == "linear" and isinstance(kwargs.get("weight"), torch.Tensor):
            weight = self.weight_name(kwargs["weight"])
        self.calls.append(Call(name, func, _copy(tuple(args)), _copy(kwargs), _copy(out), self.stack[-1], weight))
        return out

    def weight_name(self, w: torch.Tensor) -> str | None:
        """The parameter a projection's weight is, or is a view of (x @ W.T, one expert's W[e] of a stacked experts
        weight)."""
        got = self.weights.get(id(w))
        if got is None and w.ndim >= 2:
            if self._storage is None:
                self._storage = {p.untyped_storage().data_ptr(): n for n, p in self._params if p.ndim >= 2}
            got = self._storage.get(w.untyped_storage().data_ptr())
        return got

    def named(self, *names: str) -> list[Call]:
        return [c for c in self.calls if c.name in names]

    def param_name(self, t) -> str | None:
        return self.names.get(id(t)) if isinstance(t, torch.Tensor) else None


@dataclass
class Probe:
    """The block as the readers see it: a float64 copy in eval mode (the caller's subject is never changed)."""

    subject: object  # loading.Subject around the float64 copy
    cfg: BlockConfig
    device: torch.device
    seed: int = 0
    gen: torch.Generator = field(init=False)
    memo: dict = field(default_factory=dict, repr=False)  # what one reader reads and others reuse (spec.sublayers)

    def __post_init__(self):
        self.gen = torch.Generator().manual_seed(self.seed + 4321)

    @property
    def module(self) -> nn.Module:
        return self.subject.module

    @property
    def d(self) -> int:
        return self.cfg.d_model

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, dtype=torch.float64) * scale).to(self.device)

    def x(self, batch: int = 1, seq: int | None = None, scale: float = 1.0) -> torch.Tensor:
        return self.randn(batch, seq or max(self.cfg.seq, 8), self.d, scale=scale)

    def identical(self, seq: int, scale: float = 1.0) -> torch.Tensor:
        """(1, seq, d): one random token repeated, so whatever differs between positions came from positions."""
        return self.randn(1, 1, self.d, scale=scale).expand(1, seq, self.d).contiguous()

    def forward(self, x: torch.Tensor, pad_mask=None) -> torch.Tensor:
        with train_mode(self.module, False), torch.no_grad():
            return self.subject(x.clone(), pad_mask)

    def capture(self, x: torch.Tensor) -> tuple[Capture, torch.Tensor]:
        cap = Capture(self.module)
        try:
            with train_mode(self.module, False), torch.no_grad(), cap:
                out = self.subject(x.clone())
        finally:
            cap.close()
        return cap, out


def float64_probe(subject, cfg: BlockConfig, device: torch.device) -> Probe:
    """A Probe around a float64 copy of the subject (on the CPU where the device has no float64)."""
    module = module_copy(subject.module)
    where = torch.device("cpu") if device.type == "mps" else device
    module = cast(module, torch.float64, where)
    return Probe(subject.like(module), cfg, where, cfg.seed)
