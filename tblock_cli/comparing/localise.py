"""Where two blocks with the same weights part ways: role outputs captured in both, the first that differs named.

Captured in execution order on one eval forward (grad enabled, which keeps nn.TransformerEncoderLayer and
nn.MultiheadAttention off their fused paths): norm outputs, q/k/v projections (a fused one split by its
slots), what the attention kernel reads (q, k, v after positions, at an SDPA call), attention weights (a
softmax over a q.k product), the attention output (what the out projection reads), the FFN's gate/in
projections, the FFN hidden state (what the down projection reads: the activation and any gating) and the
FFN output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tblock_cli.probes import f64, rel_diff, train_mode

# Components in the order a block computes them; a capture's key is (component, occurrence).
COMPONENTS = ("norm", "attn.q", "attn.k", "attn.v", "attn.q_pos", "attn.k_pos", "attn.v_kernel", "attn.weights",
              "attn.output", "attn.out", "ffn.gate", "ffn.in", "ffn.hidden", "ffn.out")
# A head permutation is searched only for this few heads or fewer (an H x H table of comparisons).
MAX_PERMUTED_HEADS = 64


@dataclass(frozen=True)
class ComponentDiff:
    component: str  # one of COMPONENTS, with its occurrence: "attn.k_pos#0"
    rel: float  # max |A - B| / max(1, max |A|), float64
    max_abs: float
    shape: tuple[int, ...]


class KernelInputs(TorchFunctionMode):
    """Records what attention reads: SDPA's q, k, v; or, written out, the operands of the (B, H, L, S) q.k^T product
    that a softmax normalises, the weights, and the values they multiply."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink
        self.product = None  # (scores shape, q, k^T) of the last 4-D product of two activations
        self.weights = None  # shape of the last attention weights, until their values arrive

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            q, k, v = (kwargs.get(n, args[i] if len(args) > i else None) for i, n in enumerate(("query", "key", "value")))
            for key, t in (("attn.q_pos", q), ("attn.k_pos", k), ("attn.v_kernel", v)):
                self.sink(key, t)
        elif name in ("matmul", "__matmul__") and len(args) == 2 and all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in args):
            a, b = args
            if self.weights is not None and self.weights in (tuple(a.shape), tuple(b.shape)):
                self.sink("attn.v_kernel", b if tuple(a.shape) == self.weights else a)
                self.weights = None
            else:
                self.product = (tuple(out.shape), a, b)
        elif name in ("softmax", "_softmax") and isinstance(out, torch.Tensor) and out.ndim == 4:
            if self.product is not None and self.product[0] == tuple(out.shape):
                self.sink("attn.q_pos", self.product[1])
                self.sink("attn.k_pos", self.product[2].transpose(-2, -1))
            self.product, self.weights = None, tuple(out.shape)
            self.sink("attn.weights", out)
        return out


def capture(module: nn.Module, call, x: torch.Tensor, slots) -> list[tuple[str, torch.Tensor]]:
    """(component#k, float64 tensor) in execution order, for one eval forward of call(x)."""
    by_module: dict[str, list] = {}
    for s in slots:
        if s.role == "other" or s.part != "weight":
            continue
        mod = s.param.rsplit(".", 1)[0] if "." in s.param else ""
        by_module.setdefault(mod, []).append(s)
    found: list[tuple[str, torch.Tensor]] = []
    seen: dict[str, int] = {}

    def put(name, t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            k = seen.get(name, 0)
            seen[name] = k + 1
            found.append((f"{name}#{k}", f64(t)))

    modules = dict(module.named_modules())
    hooks = []
    for mod, ss in by_module.items():
        m = modules.get(mod)
        if isinstance(m, nn.MultiheadAttention):  # its projections run inside one function: its output is what shows
            hooks.append(m.register_forward_hook(lambda _m, _a, out: put("attn.out", out[0] if isinstance(out, tuple) else out)))
            continue
        if m is None:
            continue
        roles = {s.role for s in ss}
        if roles & {"attn.out", "ffn.out"}:
            inner = "attn.output" if "attn.out" in roles else "ffn.hidden"
            hooks.append(m.register_forward_pre_hook(lambda _m, a, _n=inner: put(_n, a[0] if a else None)))

        def after(_m, _a, out, _ss=ss):
            if not isinstance(out, torch.Tensor):
                return
            for s in _ss:
                put(s.role, out[..., s.rows[0]:s.rows[1]] if s.rows else out)
        hooks.append(m.register_forward_hook(after))
    try:
        with train_mode(module, False), torch.enable_grad(), KernelInputs(put):
            call(x)
    finally:
        for h in hooks:
            h.remove()
    return found


def conform(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two captures in one shape: GQA keys with fewer heads on one side are expanded as SDPA's enable_gqa does."""
    if a.shape == b.shape:
        return a, b
    if a.ndim == 4 and b.ndim == 4 and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]:
        ha, hb = a.shape[1], b.shape[1]
        if ha < hb and hb % ha == 0:
            return a.repeat_interleave(hb // ha, dim=1), b
        if hb < ha and ha % hb == 0:
            return a, b.repeat_interleave(ha // hb, dim=1)
    return None


def component_diffs(cap_a: list, cap_b: list) -> list[ComponentDiff]:
    """Every component both captured, in A's order, with its difference."""
    got_b = dict(cap_b)
    out = []
    for key, ta in cap_a:
        tb = got_b.get(key)
        pair = conform(ta, tb) if tb is not None else None
        if pair is None:
            continue
        ta, tb = pair
        out.append(ComponentDiff(key, rel_diff(tb, ta), (tb - ta).abs().max().item() if ta.numel() else 0.0, tuple(ta.shape)))
    return out


def as_heads(t: torch.Tensor, head_dim: int) -> torch.Tensor | None:
    """(B, H, T, hd) from a kernel input, or from a projection's (B, T, H*hd)."""
    if t.ndim == 4:
        return t
    if t.ndim == 3 and head_dim and t.shape[-1] % head_dim == 0:
        return t.unflatten(-1, (-1, head_dim)).transpose(1, 2)
    return None


def head_permutation(a: torch.Tensor, b: torch.Tensor, head_dim: int, tol: float) -> list[int] | None:
    """perm with B's head j equal to A's head perm[j], when one exists and is not the identity."""
    ha, hb = as_heads(a, head_dim), as_heads(b, head_dim)
    if ha is None or hb is None or ha.shape != hb.shape or ha.shape[1] > MAX_PERMUTED_HEADS:
        return None
    H = ha.shape[1]
    perm = []
    for j in range(H):
        match = [i for i in range(H) if i not in perm and rel_diff(hb[:, j], ha[:, i]) <= tol]
        if not match:  # repeated GQA heads are alike: each A head is taken once
            return None
        perm.append(match[0])
    return perm if perm != list(range(H)) and sorted(perm) == list(range(H)) else None


def rotary_layout(pre: torch.Tensor, post: torch.Tensor, head_dim: int, tol: float) -> str | None:
    """Which pairs of features a rotary embedding rotated, from the pair norms it must keep: 'half-split'
    (i, i + hd/2; HF's rotate_half) or 'interleaved' (2i, 2i+1; Meta's checkpoints)."""
    a, b = as_heads(pre, head_dim), as_heads(post, head_dim)
    if a is None or b is None or a.shape != b.shape or a.shape[-1] % 2:
        return None
    h = a.shape[-1] // 2
    norms = {
        "half-split": lambda t: (t[..., :h] ** 2 + t[..., h:] ** 2).sqrt(),
        "interleaved": lambda t: (t[..., 0::2] ** 2 + t[..., 1::2] ** 2).sqrt(),
    }
    if rel_diff(b, a) <= tol:
        return None  # no rotation happened
    kept = [name for name, pn in norms.items() if rel_diff(pn(b), pn(a)) <= tol]
    return kept[0] if len(kept) == 1 else None


def explain(diffs: list[ComponentDiff], cap_a: list, cap_b: list, head_dim: int, tol: float) -> dict | None:
    """The first component that differs, with what it looks like: a head permutation, a rotary layout."""
    first = next((d for d in diffs if d.rel > tol), None)
    if first is None:
        return None
    ta, tb = dict(cap_a)[first.component], dict(cap_b)[first.component]
    pair = conform(ta, tb)
    facts = {"component": first.component, "rel": first.rel, "max_abs": first.max_abs}
    if pair is not None and first.component.startswith(("attn.q", "attn.k", "attn.v", "attn.output")):
        perm = head_permutation(*pair, head_dim, tol)
        if perm is not None:
            facts["heads_permutation"] = perm
    if first.component.startswith(("attn.q_pos", "attn.k_pos")):
        pre = first.component.replace("_pos", "")
        layouts = []
        for cap in (cap_a, cap_b):
            got = dict(cap)
            layouts.append(rotary_layout(got[pre], got[first.component], head_dim, tol)
                           if pre in got and first.component in got else None)
        if layouts[0] and layouts[1] and layouts[0] != layouts[1]:
            facts["rotary"] = {"a": layouts[0], "b": layouts[1]}
    return facts


def head_dim_of(flow) -> int:
    return next((c.head_dim for c in flow.attention), 0)

