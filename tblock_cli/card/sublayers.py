"""What the ffn, norms and residual readers share: one traced forward of the float64 copy giving each projection's role
(the dataflow's, never a name), each projection's input and output, and each stream norm's input and output, in call
order. Read once per probe (memoised on it); readers that change parameters read afresh with `io_of`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.card.probe import Probe

FUNCTIONAL_NORMS = ("layer_norm", "rms_norm")  # over the last axis (group_norm normalises channels of dim 1)
QK_ROLES = ("attn.q", "attn.k", "attn.qk", "attn.qkv", "attn.kv")
# two captured tensors are "the same tensor" (a norm reading a projection's output) within this relative distance:
# float64 copies of one tensor are equal to 0; a float32 cast on the way (HF norms upcast) moves them by ~1e-7
SAME_TENSOR_TOL = 1e-5


@dataclass(frozen=True)
class Seen:
    """One forward of the float64 copy: what each projection and each stream norm read and wrote (first call each)."""

    x: torch.Tensor  # the block's input (B, T, d)
    y: torch.Tensor  # its output
    proj_in: dict  # projection name -> its input (a (tokens, width) float64 tensor), where it was seen
    proj_out: dict  # projection name -> its output (tokens, width)
    norm_in: dict  # stream-norm module name -> its input (tokens, d)
    norm_out: dict
    norm_order: tuple[str, ...]  # stream norms in the order they ran
    module_out: dict = None  # the sublayers' own modules (the smallest holding all of a branch's projections) -> output
    functional: dict = None  # a norm called as a function outside any norm module (F.layer_norm, F.rms_norm) -> the call


@dataclass(frozen=True)
class Sublayers:
    flow: object  # anatomy Dataflow of the float64 copy
    roles: dict  # role -> projection names, in the order they ran
    norms: tuple[str, ...]  # modules normalising over the full width (width d_model), in the order they ran
    qk_norms: tuple[str, ...]  # full-width norms that read a query or key projection (olmo2's q_norm): not stream norms
    seen: Seen
    params: dict  # projection name -> its parameter names (weight first, then bias)

    def norm(self, module: nn.Module, name: str):
        """A stream norm as a callable on a (B, T, d) tensor: its module, or its function with the call's other
        arguments (weight, eps); None where it is not a module (then its weight cannot be set apart)."""
        c = self.seen.functional.get(name)
        if c is None:
            return dict(module.named_modules())[name]
        return lambda t: c.func(t, *c.args[1:], **c.kwargs)

    def holder(self, prefix: str) -> str | None:
        """The module holding every projection of a branch (attn, ffn), other than the block itself."""
        return holder([n for r, ns in self.roles.items() if r.startswith(prefix) for n in ns])

    def first(self, role: str) -> str | None:
        names = self.roles.get(role, ())
        return names[0] if names else None


def holder(names: list[str]) -> str | None:
    """The smallest module holding every one of these projections (by their dotted names), or None for the root."""
    if not names:
        return None
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or None


def _flat(t) -> torch.Tensor | None:
    if isinstance(t, (tuple, list)) and t:
        t = t[0]
    if not isinstance(t, torch.Tensor) or t.ndim == 0:
        return None
    return t.detach().double().reshape(-1, t.shape[-1]).clone()


def projection_params(module: nn.Module, name: str) -> tuple[str, ...]:
    """A dataflow row's parameters: a bare parameter's own name, or a module's weight matrix then its bias."""
    params = dict(module.named_parameters())
    if name in params:
        return (name,)
    mods = dict(module.named_modules())
    m = mods.get(name)
    if m is None:
        return ()
    own = [(n, p) for n, p in m.named_parameters(recurse=False)]
    mats = [f"{name}.{n}" for n, p in own if p.ndim >= 2]
    vecs = [f"{name}.{n}" for n, p in own if p.ndim < 2]
    return tuple(mats[:1] + vecs)


def io_of(probe: Probe, projections: dict, norms: tuple[str, ...], x: torch.Tensor, modules: tuple[str, ...] = ()) -> Seen:
    """One captured forward of x: each projection's (input, output) from its F.linear call (its weight named) or its
    module's hooks (nn.MultiheadAttention's out_proj: the MHA module's output), each norm's from its hooks."""
    module = probe.module
    mods = dict(module.named_modules())
    by_weight = {params[0]: n for n, params in projections.items() if params}
    hooked: dict[str, tuple] = {}
    order: list[str] = []
    hooks = []

    def keep(name):
        def hook(_m, args, out):
            if name not in hooked:  # a norm fused with the residual add, norm(a, x), reads no one tensor: input unknown
                one = args and sum(isinstance(a, torch.Tensor) for a in args) == 1
                hooked[name] = (_flat(args[0]) if one else None, _flat(out))
                order.append(name)
        return hook

    try:
        for name, m in mods.items():
            if name in projections or name in norms or name in modules or isinstance(m, nn.MultiheadAttention):
                hooks.append(m.register_forward_hook(keep(name)))
        cap, y = probe.capture(x)
    finally:
        for h in hooks:
            h.remove()
    p_in, p_out = {}, {}
    for c in cap.calls:
        n = by_weight.get(c.weight) if c.name in ("linear", "matmul", "__matmul__", "bmm") else None
        if n is not None and n not in p_out:
            p_in[n], p_out[n] = _flat(c.args[0]), _flat(c.out)
    for n in projections:
        if n in p_out:
            continue
        if n in hooked:
            p_in[n], p_out[n] = hooked[n]
            continue
        parent = n.rpartition(".")[0]
        if isinstance(mods.get(parent), nn.MultiheadAttention) and parent in hooked:  # its out_proj runs inside the call
            p_out[n] = hooked[parent][1]
    n_in = {n: hooked[n][0] for n in norms if n in hooked}
    n_out = {n: hooked[n][1] for n in norms if n in hooked}
    functional = {}
    for c in cap.calls:  # a norm called as a function in the block's own forward: read through the call itself
        inside = any(c.module == n or c.module.startswith(n + ".") for n in norms)
        if c.name in FUNCTIONAL_NORMS and not inside and isinstance(c.out, torch.Tensor) and c.out.shape[-1] == probe.d:
            out = _flat(c.out)
            # one that feeds no projection and is not the output ran outside the block (an HF model's embedding norm)
            if not any(same_tensor(out, t) for t in list(p_in.values()) + [_flat(y)]):
                continue
            key = f"{c.module or 'block'}:{c.name}#{len(functional)}"
            functional[key] = c
            n_in[key], n_out[key] = _flat(c.args[0]), out
    ran = tuple(n for n in order if n in norms) + tuple(functional)
    return Seen(x, y.detach().double().clone(), p_in, p_out, n_in, n_out, ran,
                {n: hooked[n][1] for n in modules if n in hooked}, functional)


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    scale = max(a.abs().max().item(), 1e-300)
    return (a - b).abs().max().item() <= SAME_TENSOR_TOL * scale


def sublayers(probe: Probe) -> Sublayers:
    """The probe's sublayers, read once and kept on the probe for the other readers."""
    memo = probe.memo.get("sublayers")
    if memo is None:
        memo = probe.memo["sublayers"] = _read(probe)
    return memo


def dataflow(probe: Probe, x: torch.Tensor | None = None):
    """The anatomy of the probe's float64 copy, traced once and kept for any reader that needs it."""
    from tblock_cli.anatomy import trace

    flow = probe.memo.get("dataflow")
    if flow is None:
        flow = probe.memo["dataflow"] = trace(probe.module, probe.subject, probe.x() if x is None else x, probe.d)
    return flow


def _read(probe: Probe) -> Sublayers:
    module = probe.module
    x = probe.x()
    flow = dataflow(probe, x)
    projections = {m.name: projection_params(module, m.name) for m in flow.modules if m.role.startswith(("attn", "ffn"))}
    full = tuple(n for n, w in flow.norms.items() if w == probe.d)
    branches = tuple(b for b in (holder([m.name for m in flow.modules if m.role.startswith(r)]) for r in ("attn", "ffn")) if b)
    seen = io_of(probe, projections, full, x, branches)
    ran = {n: i for i, n in enumerate(list(seen.proj_out))}
    roles: dict[str, list[str]] = {}
    for m in flow.modules:
        if m.name in projections:
            roles.setdefault(m.role, []).append(m.name)
    order = {n: i for i, n in enumerate(seen.norm_order)}
    roles = {r: tuple(sorted(ns, key=lambda n: ran.get(n, len(ran)))) for r, ns in roles.items()}
    qk_outs = [seen.proj_out.get(n) for r in QK_ROLES for n in roles.get(r, ())]
    full = full + tuple(seen.functional)
    qk = tuple(n for n in full if any(same_tensor(seen.norm_in.get(n), o) for o in qk_outs))
    stream = tuple(sorted((n for n in full if n not in qk and n in order), key=order.get))
    return Sublayers(flow, roles, stream, qk, seen, projections)
