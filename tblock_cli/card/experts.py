"""Where a block's mixture of experts is: its experts (a list of same-shaped modules, or parameters stacked on an
expert axis), its router (a linear to one output per expert), and its module, run alone with its experts' weights
changed and restored by the moe reader."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.card.probe import Probe
from tblock_cli.probes import train_mode

# Calls that choose experts from the router's outputs.
SELECT = frozenset({"topk", "sort", "argsort", "max", "argmax", "kthvalue"})
# Routers are linears of the stream; experts read with E + 3 runs of the mixture alone, so a cap keeps a
# 1024-expert layer under a few seconds (DeepSeek-V3's 256 take 1.5 s at d_model 64).
MAX_EXPERTS = 1024
# Tokens the per-expert runs read where the experts are many: enough weights to fit a routing form (>= 4 x top-k),
# few enough that E runs stay cheap.
FEW_TOKENS = 4
MANY_EXPERTS = 64


@dataclass
class Experts:
    """E experts as slices of parameters: experts[e] lists (parameter, index) — index None for a whole parameter
    (a list of expert modules), e for the e-th slice of a stacked parameter (HF's (E, 2f, d) gate_up_proj)."""

    path: str  # the module holding them (the list, or the owner of the stacked parameters)
    slices: list[list[tuple[nn.Parameter, int | None]]]
    modules: list[nn.Module] | None  # one module per expert, where they are modules
    owner: nn.Module | None = None  # the module holding stacked parameters (called as HF's experts are)
    scopes: tuple[str, ...] | None = None  # where they live, if not all under `path` (sibling modules of it)

    def holds(self, call) -> bool:
        """A call the experts make: inside their own modules; for matrices stacked in one module, a call in that
        module's own forward on a slice of them (its children, a router among them, are not the experts)."""
        if self.modules is not None or self.scopes:
            return any(_within(call.module, s) for s in (self.scopes or (self.path,)))
        own = {n for n, p in self.owner.named_parameters(recurse=False) if any(p is q for q in self.params())}
        return call.module == self.path and (call.weight is None or call.weight.rpartition(".")[2] in own)

    @property
    def n(self) -> int:
        return len(self.slices)

    def tensors(self, e: int) -> list[torch.Tensor]:
        return [p if i is None else p[i] for p, i in self.slices[e]]

    def params(self) -> list[nn.Parameter]:
        return list({id(p): p for s in self.slices for p, _ in s}.values())


def _matrices(params, e: int) -> list[nn.Parameter]:
    """Parameters stacked on a leading axis of e experts: each slice a matrix (E, out, in) (a depthwise convolution's
    (C, 1, k) is not one), with 2-D (E, width) biases beside them."""
    big = [p for p in params if p.dim() == 3 and p.shape[0] == e and min(p.shape[1:]) > 1]
    return big + [p for p in params if p.dim() == 2 and p.shape[0] == e] if big else []


def _groups(module: nn.Module) -> list[Experts]:
    """Every set of >= 2 same-shaped experts: a module list (or dict) of identical structure, or matrices stacked on
    a leading expert axis (held by one module, or by its children: JetMoE's input and output ParallelExperts)."""
    out: list[Experts] = []
    for name, m in module.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and len(m) >= 2:
            kids = list(m.values()) if isinstance(m, nn.ModuleDict) else list(m)
            shapes = [[(n, tuple(p.shape)) for n, p in c.named_parameters()] for c in kids]
            if shapes[0] and all(s == shapes[0] for s in shapes) and len({type(c) for c in kids}) == 1:
                out.append(Experts(name, [[(p, None) for p in c.parameters()] for c in kids], kids))
        own = list(m.parameters(recurse=False))
        for e in sorted({p.shape[0] for p in own if p.dim() == 3}):
            stacked = _matrices(own, e)
            if e >= 2 and stacked:
                out.append(Experts(name, [[(p, i) for p in stacked] for i in range(e)], None, m))
        kids = [(n, list(c.parameters(recurse=False))) for n, c in m.named_children()]
        for e in sorted({p.shape[0] for _, ps in kids for p in ps if p.dim() == 3}):
            held = [(n, _matrices(ps, e)) for n, ps in kids]
            held = [(n, ps) for n, ps in held if ps]
            if e >= 2 and len(held) >= 2:  # the experts' matrices in sibling modules
                stacked = [p for _, ps in held for p in ps]
                out.append(Experts(name, [[(p, i) for p in stacked] for i in range(e)], None, m,
                                   tuple(qualified(name, n) for n, _ in held)))
    return out


def qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(path: str, scope: str) -> bool:
    return scope == "" or path == scope or path.startswith(scope + ".")


def _ancestor(a: str, b: str) -> str:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def find(probe: Probe, cap) -> tuple[Experts, object, str, bool] | None:
    """The experts, the router (a linear of the stream to one output per expert, outside the experts: the last such
    before the experts first run), whether a selection over its outputs follows it, and the mixture's module (the
    innermost holding both)."""
    found = []
    for g in _groups(probe.module):
        if g.n > MAX_EXPERTS:
            continue
        linears = [i for i, c in enumerate(cap.calls) if c.name == "linear" and isinstance(c.out, torch.Tensor)
                   and c.out.shape[-1] == g.n and not g.holds(c)]
        used = next((i for i, c in enumerate(cap.calls) if g.holds(c) and i > (linears or [0])[0]), None)
        before = [i for i in linears if used is None or i < used]
        if not before:
            continue
        i = before[-1]  # the router: the last linear to one output per expert before the experts run
        select = any(c.name in SELECT and any(t.dim() and t.shape[-1] == g.n for t in c.tensor_args())
                     for c in cap.calls[i + 1: used])
        c = cap.calls[i]
        found.append((i, g, c, _ancestor(g.path, c.module), select))
    if not found:
        return None
    # the last routed mixture of the forward (an FFN's, after a mixture of attention heads as in JetMoE)
    _, g, c, path, selects = max(found, key=lambda f: f[0])
    return g, c, path, selects


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return getattr(out, "last_hidden_state", None)


class Mixture:
    """The mixture run alone on the input it saw in the probe's forward (or the whole block where the mixture is
    not a module of its own), with its experts' parameters saved and restored."""

    def __init__(self, probe: Probe, path: str, x: torch.Tensor):
        self.probe, self.x = probe, x
        self.alone = path != ""
        self.module = probe.module.get_submodule(path) if self.alone else probe.module
        seen = {}
        if self.alone:
            def keep(_m, args, kwargs):
                seen.setdefault("args", (args, kwargs))
            h = self.module.register_forward_pre_hook(keep, with_kwargs=True)
            try:
                probe.forward(x)
            finally:
                h.remove()
            if "args" not in seen:
                raise RuntimeError(f"the mixture module {path!r} did not run")
            self.args, self.kwargs = seen["args"]

    def __call__(self) -> torch.Tensor:
        if not self.alone:
            out = self.probe.forward(self.x)
        else:
            with train_mode(self.probe.module, False), torch.no_grad():
                out = first_tensor(self.module(*self.args, **self.kwargs))
        return out.reshape(-1, out.shape[-1]).clone()

    def limit(self, n: int) -> int:
        """Run on the first n tokens only (E runs of a many-expert mixture cost E x the experts it hits); the number
        of tokens it then runs on."""
        if not self.alone or not self.args or not isinstance(self.args[0], torch.Tensor) or self.args[0].dim() < 2:
            return -1
        full = self.args
        t = full[0]
        axis = t.dim() - 2
        if t.shape[axis] <= n or (axis and t.shape[0] != 1):
            return -1
        self.args = (t.narrow(axis, 0, n),) + tuple(full[1:])
        try:
            self()
        except Exception:  # noqa: BLE001 - a mixture that wants its full input: run it whole
            self.args = full
            return -1
        return n

    @property
    def input(self) -> torch.Tensor | None:
        if not self.alone:
            return None
        t = first_tensor(self.args) if self.args else first_tensor(tuple(self.kwargs.values()))
        return t


def one_expert(g: Experts, u: torch.Tensor) -> torch.Tensor | None:
    """Expert 0's output on the tokens u (N, d): the module itself, or stacked experts called as HF's are (tokens,
    chosen indices, weights) with expert 0 chosen at weight 1."""
    with torch.no_grad():
        try:
            if g.modules is not None:
                out = first_tensor(g.modules[0](u))
            else:
                idx = torch.zeros(u.shape[0], 1, dtype=torch.long, device=u.device)
                out = first_tensor(g.owner(u, idx, torch.ones(u.shape[0], 1, dtype=u.dtype, device=u.device)))
        except Exception:  # noqa: BLE001 - an expert that cannot be called alone: the scale is then not read
            return None
    return out if isinstance(out, torch.Tensor) and out.shape == u.shape else None
