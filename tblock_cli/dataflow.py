"""A block's anatomy read from one traced forward: which modules feed attention, which form the FFN, which normalise.

Mechanism: a `TorchFunctionMode` sees every torch function the forward calls, at the level the user
wrote it (`F.linear`, `torch.addmm`, `F.scaled_dot_product_attention`, `F.multi_head_attention_forward`,
`softmax`, `@`), whatever the modules are called and however they nest. Each tensor carries a
provenance: the projections (modules owning a weight matrix) whose outputs reach it with no other
projection in between, and whether a nonlinearity acted since. Attention is recognised by what it
does: an SDPA or MHA call, or a softmax over a product of two activations whose product is then
multiplied by a third. Norms are recognised by what they do too: a module with only per-feature
parameters whose output is invariant to scaling each token. `torch.fx` and `torch.export` were set
aside: both need the forward to be traceable as a graph, and user blocks branch on shapes, call
Python helpers and read `self.training`; the mode needs nothing of the code but that it runs.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tblock_cli.probes import train_mode

ATTENTION_ROLES = ("attn.q", "attn.k", "attn.v", "attn.qk", "attn.kv", "attn.qkv", "attn.out", "attn.gate")
FFN_ROLES = ("ffn.in", "ffn.gate", "ffn.out")
GROUPS = ("attention", "ffn", "norm", "other")

# Provenance flags: an activation function acted (gelu, silu, ...), or another nonlinearity did (a
# product of two activations, exp, ...). A projection reached with neither composes linearly.
ACT, NONLINEAR = 1, 2
ACTIVATIONS = {"gelu", "relu", "relu_", "silu", "silu_", "sigmoid", "tanh", "softplus", "mish", "elu", "selu", "celu",
               "leaky_relu", "hardswish", "hardsigmoid", "hardtanh", "relu6", "glu", "erf", "gelu_", "quick_gelu", "logsigmoid"}
# Functions that are linear in each tensor argument (or only move data): provenance passes through
# unflagged. Anything not listed here counts as a nonlinearity, so the linear-FFN finding stays conservative.
LINEAR = {"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__", "rsub", "__isub__", "neg",
          "__neg__", "view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "split", "chunk",
          "unbind", "__getitem__", "squeeze", "unsqueeze", "expand", "expand_as", "clone", "to", "type", "float", "half",
          "bfloat16", "double", "dropout", "dropout_", "cat", "stack", "concat", "concatenate", "masked_fill", "masked_fill_",
          "narrow", "select", "repeat", "repeat_interleave", "view_as", "reshape_as", "movedim", "swapaxes", "roll", "flip",
          "split_with_sizes", "tensor_split", "t", "mT", "detach", "sum", "mean", "pad", "index_select", "gather", "tile"}
SCALING = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "div", "div_", "__truediv__", "true_divide", "__itruediv__"}
MATMULS = {"matmul", "__matmul__", "bmm", "einsum", "mm", "baddbmm"}
SOFTMAX = {"softmax", "_softmax"}
# A norm leaves each token's output unchanged when the token is scaled (LayerNorm, RMSNorm): checked
# at this relative tolerance in float64 (eps moves a unit-scale token by ~eps, far below it).
NORM_INVARIANCE_TOL = 1e-4
# Scores below this are a mask (-inf, finfo.min, -1e9), not a logit.
MASKED_LOGIT = -1e4
# Rows of attention weights written out by hand must sum to 1 within this (half precision rounds to ~1e-3).
WEIGHT_SUM_TOL = 1e-2


@dataclass(frozen=True)
class AttentionCall:
    """One attention computation seen on the probe input."""

    kind: str  # nn.MultiheadAttention | scaled_dot_product_attention | softmax(QK^T)V
    where: str  # the module it ran in
    q: tuple[str, ...]  # projections whose outputs reach the queries
    k: tuple[str, ...]
    v: tuple[str, ...]
    heads: int
    head_dim: int
    batch: int
    q_len: int
    k_len: int
    logit_std: float  # std of the scores over unmasked entries
    entropy: float  # mean row entropy / log(keys allowed): 1 = uniform
    max_prob: float  # mean over rows of the largest attention weight
    scale_ratio: float | None  # logit std / (rms(q) rms(k)) from the projections: 1 at 1/sqrt(d_head), sqrt(d_head) unscaled
    scale_note: str  # where the scale came from
    flops: int  # scores + weighted sum, multiply-add = 2
    kv_width: int = 0  # key + value elements per token: what a decoding cache keeps for this call
    key_axis: bool = True  # the softmax normalises over the keys (the last axis), as attention must
    self_masked: bool = False  # L == S and every query's own position is masked: no token attends to itself
    normalised: bool = True  # the weights multiplied into the values are non-negative and each row sums to 1


@dataclass(frozen=True)
class ModuleUse:
    """A module that owns parameters, with the role the dataflow gave it."""

    name: str
    role: str  # attn.q ... attn.out, ffn.in / ffn.gate / ffn.out, norm, other
    params: int  # its own parameters not already counted for another module
    matrix_params: int  # of which weight matrices (ndim >= 2)
    out_shape: tuple[int, ...] | None  # on the probe input
    flops: int  # forward matmul FLOPs it ran on the probe input

    @property
    def group(self) -> str:
        return group_of(self.role)


@dataclass(frozen=True)
class Dataflow:
    modules: tuple[ModuleUse, ...]
    attention: tuple[AttentionCall, ...]
    linear_chains: tuple[tuple[str, str], ...]  # FFN (first, second) projections with no nonlinearity between
    tokens: int  # batch x seq of the probe
    total: int  # parameters, shared tensors once
    stream_norms: bool = False  # some norm normalises the residual stream (width d_model)
    unnormed_attention: tuple[str, ...] = ()  # query projections that read no normalised stream
    unnormed_ffn: tuple[str, ...] = ()  # FFN input projections that read no normalised stream
    split_kv: tuple[str, ...] = ()  # key/value projections that read the raw stream while their queries read a normalised one
    output_normed: bool = False  # the block's output comes straight from a norm (Post-LN)
    norms: dict = field(default_factory=dict)  # module name -> width of every norm module found (find_norms)

    def group_params(self, matrices_only: bool = False) -> dict[str, int]:
        out = dict.fromkeys(GROUPS, 0)
        for m in self.modules:
            out[m.group] += m.matrix_params if matrices_only else m.params
        return out

    @property
    def found(self) -> dict[str, bool]:
        return {"attention": bool(self.attention), "ffn": any(m.group == "ffn" for m in self.modules)}


def predicted_ffn_share(mats: dict[str, int]) -> float:
    """The FFN share the weight matrices alone predict: ffn / (ffn + attention); 2r / (4 + 2r) for d_ff = r d."""
    return mats["ffn"] / (mats["ffn"] + mats["attention"]) if mats["attention"] else 1.0


def group_of(role: str) -> str:
    return role.split(".")[0].replace("attn", "attention") if role not in ("norm", "other") else role


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def self_masked(logits: torch.Tensor) -> bool:
    """Square scores whose diagonal is masked everywhere (a causal mask built with triu(0) instead of triu(1))."""
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 2:
        return False
    diag = logits.detach().double().diagonal(dim1=-2, dim2=-1)
    return bool((~(torch.isfinite(diag) & (diag > MASKED_LOGIT))).all())


def score_stats(logits: torch.Tensor) -> tuple[float, float, float]:
    """(std of unmasked logits, entropy relative to uniform, mean max probability) of (..., L, S) scores."""
    z = logits.detach().double()
    valid = torch.isfinite(z) & (z > MASKED_LOGIT)
    vals = z[valid]
    std = vals.std().item() if vals.numel() > 1 else 0.0
    p = torch.softmax(z.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
    n = valid.sum(-1)
    rows = n >= 2
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    rel = (ent[rows] / torch.log(n[rows].double())).mean().item() if rows.any() else 1.0
    return std, rel, p.amax(-1)[n >= 1].mean().item() if (n >= 1).any() else 0.0


def find_norms(module: nn.Module, d_model: int, device, dtype) -> dict[str, int]:
    """Modules that normalise over the last axis, found by what they do, not their class name: name -> width.

    A candidate owns only 1-D parameters of one size (or none, with 'norm' in its class name: width
    d_model); it is a norm when scaling each token of a random input by its own factor leaves its
    output unchanged. Width d_model: a norm of the residual stream; smaller: a per-head (QK) norm.
    """
    found: dict[str, int] = {}
    gen = torch.Generator().manual_seed(0)
    tol = NORM_INVARIANCE_TOL * (1 if dtype in (torch.float32, torch.float64) else 100)
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.MultiheadAttention)):
            continue
        own = list(m.parameters(recurse=True))
        if not own and "norm" not in type(m).__name__.lower():
            continue
        sizes = {p.shape[0] if p.ndim == 1 else -1 for p in own} or {d_model}
        if len(sizes) != 1 or len(own) > 2 or -1 in sizes:
            continue
        width = sizes.pop()
        x = torch.randn(2, 3, width, generator=gen, dtype=torch.float64)
        s = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64) * 4 + 0.5
        try:
            with torch.no_grad():
                a = m(x.to(device=device, dtype=dtype))
                b = m((x * s).to(device=device, dtype=dtype))
        except Exception:  # noqa: BLE001 - not callable on a (B, T, width) tensor: not a token norm
            continue
        if not isinstance(a, torch.Tensor) or a.shape != x.shape:
            continue
        a64, b64 = a.double().cpu(), b.double().cpu()
        if not torch.isfinite(a64).all() or a64.abs().max() == 0:
            continue
        if (a64 - b64).abs().max().item() <= tol * max(1.0, a64.abs().max().item()):
            found[name] = width
    return {n: w for n, w in found.items() if not any(n != o and n.startswith(o + ".") for o in found)}  # outermost only


def owns_several_matrices(m: nn.Module) -> bool:
    """nn.MultiheadAttention, or a module holding bare weight matrices: each matrix is a projection of its own."""
    return isinstance(m, nn.MultiheadAttention) or sum(p.ndim >= 2 for p in m.parameters(recurse=False)) > 1


def qualified(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


class _Tracer(TorchFunctionMode):
    """Records projections, attention calls and provenance while one forward runs."""

    def __init__(self, module: nn.Module, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.scalar: dict[int, float] = {}  # id(tensor) -> product of scalar factors applied to it by scaling ops
        self.owner: dict[int, str] = {}  # id(weight matrix) -> module name
        self.params: set[int] = set()
        for name, m in module.named_modules():
            per_matrix = owns_several_matrices(m)
            for pn, p in m.named_parameters(recurse=False):
                self.params.add(id(p))
                if p.ndim >= 2 and id(p) not in self.owner:
                    self.owner[id(p)] = qualified(name, pn) if per_matrix else name
            for b in m.buffers(recurse=False):
                self.params.add(id(b))
        self.prov: dict[int, dict[str, int]] = {}
        self.keep: list = []  # every traced tensor stays alive, so ids are not reused
        self.linear_in: dict[str, dict[str, int]] = {}  # projection -> provenance of its input
        self.out_shape: dict[str, tuple] = {}
        self.flops: dict[str, int] = {}
        self.attention: list[AttentionCall] = []
        self.attn_owner: list[str] = []
        self.scores: dict[str, tuple] = {}  # marker -> (A, B) of a product of two activations
        self.probs: dict[str, int] = {}  # marker -> index into self.attention
        self.mha_out: set[str] = set()
        self.stream_norms = False
        self.split_streams: list[str] = []  # MHA calls whose query is normalised but whose key or value is not
        self.module_stack: list[str] = [""]
        self.proj_outs: set[int] = set()  # ids of projection outputs

    def norm_out(self, inp, out) -> None:
        """A norm module's output: a new start of the residual stream, unless it normalises one projection's output
        (olmo2's full-width q_norm) or an attention output (bitnet's attn_sub_norm): then it stays what it read."""
        if isinstance(inp, torch.Tensor) and (id(inp) in self.proj_outs or any(k.startswith("@attn") for k in self.get(inp))):
            self.put(out, self.union([self.get(inp)], NONLINEAR))
        else:
            self.put(out, {"@norm": 0})

    def leave(self, name: str, out) -> None:
        if len(self.module_stack) > 1:
            self.module_stack.pop()
        if isinstance(out, torch.Tensor):  # the module's output shape, as torchinfo shows it
            self.out_shape[name] = tuple(out.shape)

    # ---------------------------------------------------------------- provenance helpers
    def get(self, t) -> dict[str, int]:
        return self.prov.get(id(t), {}) if isinstance(t, torch.Tensor) else {}

    def put(self, t, prov: dict[str, int]) -> None:
        for o in _tensors(t):
            self.keep.append(o)
            self.prov[id(o)] = dict(prov)

    @staticmethod
    def union(provs, flag: int = 0) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in provs:
            for k, v in p.items():
                out[k] = out.get(k, 0) | v | (flag if not k.startswith("@") else 0)
        return out

    def sources(self, t) -> tuple[str, ...]:
        return tuple(sorted(k for k in self.get(t) if not k.startswith("@")))

    def is_param(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.params

    # ---------------------------------------------------------------- the hook
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" and isinstance(out, torch.Tensor):
            self.follow_weight(args, out)  # W.T, W.mT: still the module's weight
            return out
        if name in ("__get__", "__set__") or not any(True for _ in _tensors(out)):
            return out
        if name in LINEAR and self.follow_weight(args, out, sliced=name in ("__getitem__", "index_select")):
            return out
        try:
            self.record(func, name, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a tracing slip must never break the user's forward
            pass
        return out

    def follow_weight(self, args, out, sliced: bool = False) -> bool:
        """A view or cast of a weight matrix (W.t(), W.T, W.to(dtype)) is that weight: same owner. So is one expert's
        slice of a 3-D experts weight (W[e], W[expert_ids]): mixture-of-experts layers keep the experts stacked."""
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None or id(src) not in self.owner or not isinstance(out, torch.Tensor):
            return False
        if out.numel() != src.numel() and not (sliced and src.ndim == 3):
            return False
        self.owner[id(out)] = self.owner[id(src)]
        self.params.add(id(out))
        self.keep.append(out)
        return True

    def record(self, func, name, args, kwargs, out):
        ins = [t for t in _tensors((args, kwargs))]
        acts = [t for t in ins if not self.is_param(t)]
        if func is F.linear or (name in ("addmm", "matmul", "mm", "__matmul__", "bmm", "grouped_mm", "_grouped_mm")
                                and any(id(t) in self.owner for t in ins)):
            weight = kwargs.get("weight", args[1] if func is F.linear and len(args) > 1 else None)
            if weight is None:
                weight = next(t for t in ins if id(t) in self.owner)
            proj = self.owner.get(id(weight))
            x = args[0] if func is F.linear or name != "addmm" else args[1]
            if proj is None:
                self.put(out, self.union(self.get(t) for t in acts))
                return
            self.linear_in[proj] = self.union(self.get(t) for t in acts if t is not weight)
            self.out_shape[proj] = tuple(out.shape)
            fan_in = weight.shape[-1] if func is F.linear else weight.shape[-2]
            self.flops[proj] = self.flops.get(proj, 0) + 2 * weight.numel() * (x.numel() // max(1, fan_in))
            self.put(out, {proj: 0})
            self.proj_outs.add(id(out))
        elif func is F.multi_head_attention_forward:
            self.mha(args, kwargs, out)
        elif func is F.scaled_dot_product_attention:
            self.sdpa(args, kwargs, out)
        elif name in ("layer_norm", "rms_norm", "group_norm") and func is getattr(F, name, None):
            if out.shape[-1] == self.d_model:  # a norm of the residual stream: a new start for provenance
                self.put(out, {"@norm": 0})
                self.stream_norms = True
            else:  # a per-head (QK) norm: q stays q
                self.put(out, self.union((self.get(t) for t in acts), NONLINEAR))
        elif name in SOFTMAX:
            self.softmax(args, kwargs, out, ins)
        elif name in MATMULS and len(acts) >= 2:
            self.matmul(name, args, acts, out)
        elif name in ACTIVATIONS:
            self.put(out, self.union((self.get(t) for t in acts), ACT))
        elif name in SCALING:
            with_prov = [t for t in acts if self.get(t) or t.numel() > 1]
            flag = NONLINEAR if len([t for t in acts if self.get(t)]) >= 2 else 0
            self.put(out, self.union((self.get(t) for t in with_prov), flag))
            self.track_scalar(name, args, out)
        elif name in LINEAR:
            self.put(out, self.union(self.get(t) for t in acts))
            if len(acts) == 1 and isinstance(out, torch.Tensor):  # a view or copy keeps the scalar factor
                self.scalar[id(out)] = self.scalar.get(id(acts[0]), 1.0)
        else:
            self.put(out, self.union((self.get(t) for t in acts), NONLINEAR))

    def matmul(self, name, args, acts, out):
        a, b = acts[0], acts[1]
        probs = [k for k in self.get(a) if k in self.probs] + [k for k in self.get(b) if k in self.probs]
        if probs:  # the weighted sum: attention weights times values
            i = self.probs[probs[0]]
            other = b if probs[0] in self.get(a) else a
            call = self.attention[i]
            mix = 2 * other.numel() * call.q_len  # (..., S, d_v) values, each weighted for L queries
            v_width = self.cached_width(other, other.numel() // max(1, call.batch * call.k_len))
            self.attention[i] = replace(call, v=self.sources(other), flops=call.flops + mix, kv_width=call.kv_width + v_width)
            self.put(out, {f"@attn{i}": 0})
            return
        scored = [t for t in (a, b) if any(k in self.scores for k in self.get(t))]
        if scored:  # weights derived from a q.k product, multiplied into values without torch's softmax
            w = scored[0]
            self.weights_call(w, b if w is a else a, next(k for k in self.get(w) if k in self.scores), out)
            return
        marker = f"@scores{len(self.scores)}"
        self.scores[marker] = (a, b)
        self.put(out, {**self.union((self.get(a), self.get(b)), NONLINEAR), marker: 0})

    def weights_call(self, w: torch.Tensor, values: torch.Tensor, marker: str, out) -> None:
        """Attention whose weights came from a q.k product by other means than softmax: a softmax written out
        (rows non-negative, summing to 1), or none at all (raw scores times values)."""
        q, k = self.scores[marker]
        W = w.detach().double()
        rows = W.sum(-1)
        live = rows.abs() > 1e-6  # fully masked rows, zeroed, carry no weight
        normalised = bool((W >= -1e-6).all() and live.any() and ((rows[live] - 1).abs() <= WEIGHT_SUM_TOL).all())
        L, S = W.shape[-2], W.shape[-1]
        if normalised:
            logits = torch.log(W).masked_fill(W <= 0, float("-inf"))
            valid = torch.isfinite(logits)
            centred = logits - (logits.masked_fill(~valid, 0).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1))
            std, ent, mp = score_stats(centred.masked_fill(~valid, float("-inf")))
            ratio, note = self.scale_ratio(std, q, k)
        else:
            std, ent, mp = score_stats(W)
            ratio, note = None, "no softmax: the raw scores weight the values"
        batch = W.shape[0] if W.ndim >= 3 else 1
        heads = W.shape[1] if W.ndim == 4 else 1
        e = q.shape[-1] if q.ndim >= 2 else 1
        flops = 2 * (W.numel() // max(1, S)) * S * e + 2 * values.numel() * L
        kv = (k.numel() + values.numel()) // max(1, batch * S)
        self.attention.append(AttentionCall("weights written out" if normalised else "no softmax", self.module_stack[-1],
                                            self.sources(q), self.sources(k), self.sources(values), heads, e, batch, L, S,
                                            std, ent, mp, ratio, note, flops, kv, True, self_masked(W.log() if normalised else W),
                                            normalised))
        self.put(out, {f"@attn{len(self.attention) - 1}": 0})

    def softmax(self, args, kwargs, out, ins):
        x = args[0]
        markers = [k for k in self.get(x) if k in self.scores]
        if not markers or x.ndim < 2:
            self.put(out, self.union((self.get(t) for t in ins), NONLINEAR))
            return
        a, b = self.scores[markers[-1]]
        # (..., L, E) x (..., E, S): q rows are a's, keys are b's columns (or einsum's second operand).
        heads = x.shape[1] if x.ndim == 4 else 1
        std, ent, mp = score_stats(x)
        ratio, note = self.scale_ratio(std, a, b)
        L, S = x.shape[-2], x.shape[-1]
        e = a.shape[-1] if a.ndim >= 2 else 1
        batch = x.shape[0] if x.ndim >= 3 else 1
        flops = 2 * (x.numel() // max(1, S)) * S * e
        k_width = self.cached_width(b, b.numel() // max(1, batch * S))
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        key_axis = dim is None or dim % x.ndim == x.ndim - 1
        self.attention.append(AttentionCall("softmax(QK^T)V", self.module_stack[-1], self.sources(a), self.sources(b), (),
                                            heads, e, batch, L, S, std, ent, mp, ratio, note, flops, k_width, key_axis,
                                            self_masked(x)))
        marker = f"@probs{len(self.attention) - 1}"
        self.probs[marker] = len(self.attention) - 1
        self.put(out, {marker: 0})

    def cached_width(self, t: torch.Tensor, seen: int) -> int:
        """Elements per token a cache keeps for keys (or values) t: the width of the one projection they come from
        when that is smaller than what reaches the product (grouped-query heads repeated by repeat_kv; a fused qkv
        projection is wider and keeps `seen`)."""
        src = self.sources(t)
        shape = self.out_shape.get(src[0]) if len(src) == 1 else None
        return min(seen, shape[-1]) if shape else seen

    def track_scalar(self, name: str, args, out) -> None:
        """x * c or x / c with a number c: remember the factor, so a q scaled before the product counts as scaled."""
        if not isinstance(out, torch.Tensor) or len(args) != 2 or name.startswith("__r"):
            return
        x, c = args
        if isinstance(c, torch.Tensor) and c.numel() == 1 and not self.get(c):
            c = c.item()
        if not isinstance(x, torch.Tensor) or not isinstance(c, (int, float)) or c == 0:
            return
        self.scalar[id(out)] = self.scalar.get(id(x), 1.0) * (c if name.startswith(("mul", "__mul", "__imul")) else 1 / c)

    def scale_ratio(self, logit_std: float, q: torch.Tensor, k: torch.Tensor) -> tuple[float | None, str]:
        """logit std / (rms(q) rms(k)) for q and k as they reach the product, with any scalar factor applied to
        them on the way undone: 1 for a 1/sqrt(d_head) scale (after the product or folded into q), sqrt(d_head) without."""
        rq, rk = _rms(q), _rms(k)
        if rq == 0 or rk == 0:
            return None, "q or k is zero"
        folded = abs(self.scalar.get(id(q), 1.0) * self.scalar.get(id(k), 1.0))
        note = "the q and k that reach the product" + (f" (a factor {folded:.4g} folded into them)" if folded != 1.0 else "")
        return logit_std * folded / (rq * rk), note

    def sdpa(self, args, kwargs, out):
        sig = inspect.signature(_sdpa_reference)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v = a["query"], a["key"], a["value"]
        E = q.shape[-1]
        scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(E)
        if k.ndim == 4 and q.ndim == 4 and k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1] == 0:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q.detach().double() @ k.detach().double().transpose(-2, -1)) * scale
        logits = _apply_masks(logits, a["attn_mask"], a["is_causal"])
        std, ent, mp = score_stats(logits)
        ratio, note = self.scale_ratio(std, q, k)
        note += "; scale " + (f"{a['scale']:.4g} passed" if a["scale"] is not None else "1/sqrt(E) by default")
        L, S = q.shape[-2], k.shape[-2]
        heads = q.shape[1] if q.ndim == 4 else 1
        batch = q.shape[0] if q.ndim >= 3 else 1
        flops = 2 * (q.numel() // E) * S * E + 2 * (q.numel() // E) * S * v.shape[-1]
        self.attention.append(AttentionCall("scaled_dot_product_attention", self.module_stack[-1], self.sources(a["query"]),
                                            self.sources(a["key"]), self.sources(v), heads, E, batch, L, S, std, ent, mp,
                                            ratio, note, flops, self.cached_width(a["key"], a["key"].numel() // max(1, batch * S))
                                            + self.cached_width(v, v.numel() // max(1, batch * S)), True,
                                            self_masked(logits)))
        self.put(out, {f"@attn{len(self.attention) - 1}": 0})

    def mha(self, args, kwargs, out):
        bound = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        query, key = a["query"], a["key"]
        H, E = a["num_heads"], a["embed_dim_to_check"]
        dh = E // H
        w = a["in_proj_weight"]
        owner = self.owner.get(id(w if w is not None else a["q_proj_weight"]), "")
        mha_name = owner.rsplit(".", 1)[0] if "." in owner else ""
        if a["use_separate_proj_weight"]:
            wq, wk, wv = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        else:
            wq, wk, wv = w[:E], w[E : 2 * E], w[2 * E :]
        b = a["in_proj_bias"]
        bq, bk = (None, None) if b is None else (b[:E], b[E : 2 * E])
        batched = query.dim() == 3
        qq = query if batched else query[:, None]
        kk = key if batched else key[:, None]
        L, B, S = qq.shape[0], qq.shape[1], kk.shape[0]
        q = F.linear(qq.detach().double(), wq.detach().double(), None if bq is None else bq.detach().double())
        k = F.linear(kk.detach().double(), wk.detach().double(), None if bk is None else bk.detach().double())
        q = q.reshape(L, B * H, dh).transpose(0, 1)
        k = k.reshape(S, B * H, dh).transpose(0, 1)
        logits = (q @ k.transpose(1, 2) / math.sqrt(dh)).reshape(B, H, L, S)
        kpm = a["key_padding_mask"]
        if kpm is not None:
            pad = kpm if kpm.dtype == torch.bool else kpm < MASKED_LOGIT
            logits = logits.masked_fill(pad.reshape(B, 1, 1, S) if batched else pad.reshape(1, 1, 1, S), float("-inf"))
        mask = a["attn_mask"]
        if a["is_causal"] and mask is None:
            mask = torch.ones(L, S, dtype=torch.bool).triu(1)
        if mask is not None:  # MHA's attn_mask: True (or -inf) = not allowed; (L, S) or (B * H, L, S)
            m = mask.detach().cpu()
            m = m if m.dtype == torch.bool else m.double() < MASKED_LOGIT
            logits = logits.masked_fill(m.reshape(B, H, L, S) if m.dim() == 3 else m, float("-inf"))
        std, ent, mp = score_stats(logits)
        rq, rk = _rms(q), _rms(k)
        ratio = std / (rq * rk) if rq and rk else None
        flops = 4 * B * H * L * S * dh
        roles = (owner,) if owner else ()
        sep = a["use_separate_proj_weight"]
        qn = (self.owner.get(id(a["q_proj_weight"]), ""),) if sep else roles
        kn = (self.owner.get(id(a["k_proj_weight"]), ""),) if sep else roles
        vn = (self.owner.get(id(a["v_proj_weight"]), ""),) if sep else roles
        self.attention.append(AttentionCall("nn.MultiheadAttention", mha_name, qn, kn, vn, H, dh, B, L, S, std, ent, mp, ratio,
                                            "scale 1/sqrt(d_head), built into nn.MultiheadAttention", flops, 2 * E, True,
                                            self_masked(logits)))
        in_flops = 2 * (L * B) * (wq.numel()) + 2 * (S * B) * (wk.numel() + wv.numel())
        for n in set(qn + kn + vn):
            self.flops[n] = self.flops.get(n, 0) + in_flops // max(1, len(set(qn + kn + vn)))
            self.out_shape[n] = (B, L, E) if batched else (L, E)
        out_w = a["out_proj_weight"]
        out_name = self.owner.get(id(out_w), f"{mha_name}.out_proj")
        self.flops[out_name] = self.flops.get(out_name, 0) + 2 * L * B * out_w.numel()
        self.out_shape[out_name] = (B, L, E) if batched else (L, E)
        self.mha_out.add(out_name)
        self.linear_in[out_name] = {f"@attn{len(self.attention) - 1}": 0}
        if owner:  # the in-projection reads the query (and key, value) stream
            self.linear_in.setdefault(owner, self.union(self.get(t) for t in (query, key, a["value"])))
        if "@norm" in self.get(query) and not all("@norm" in self.get(t) for t in (key, a["value"])):
            self.split_streams.append(mha_name or "(root)")
        self.put(out, {out_name: 0})


def _sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The signature of F.scaled_dot_product_attention, to bind its arguments by name."""


def _apply_masks(logits: torch.Tensor, attn_mask, is_causal: bool) -> torch.Tensor:
    L, S = logits.shape[-2], logits.shape[-1]
    if is_causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool, device=logits.device).triu(1), float("-inf"))
    if attn_mask is not None:
        m = attn_mask.detach().to(logits.device)
        if m.dtype == torch.bool:
            logits = logits.masked_fill(~m, float("-inf"))
        else:
            logits = logits + m.double()
    return logits


def assign_roles(tr: _Tracer) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """projection name -> role, and the FFN chains that compose linearly."""
    role: dict[str, str] = {}
    qs = {n for c in tr.attention for n in c.q}
    ks = {n for c in tr.attention for n in c.k}
    vs = {n for c in tr.attention for n in c.v}
    for n in qs | ks | vs:
        key = "".join(x for x, s in (("q", qs), ("k", ks), ("v", vs)) if n in s)
        role[n] = "attn." + key if key in ("q", "k", "v", "qk", "kv", "qkv") else "attn.qkv"
    for n, p in tr.linear_in.items():
        if n not in role and any(k.startswith("@attn") for k in p):
            role[n] = "attn.out"
    for n in [n for n, r in role.items() if r == "attn.out"]:  # a gate on the attention output (afmoe, qwen3_next)
        for src in tr.linear_in.get(n, {}):
            if src in tr.linear_in and src not in role:
                role[src] = "attn.gate"
    for n in [n for n, r in role.items() if r not in ("attn.out", "attn.gate")]:
        src = list(tr.linear_in.get(n, {}))
        if len(src) == 1 and src[0] in tr.linear_in and src[0] not in role:  # fed by one projection alone
            role[src[0]] = role[n]
    # FFN: a projection that consumes another (non-attention) projection's output.
    chains = []
    consumed: dict[str, list[tuple[str, int]]] = {}
    for n, p in tr.linear_in.items():
        if n in role:
            continue
        preds = [(s, f) for s, f in p.items() if not s.startswith("@") and s in tr.linear_in and s not in role]
        if preds:
            consumed[n] = preds
    for out_name, preds in consumed.items():
        role.setdefault(out_name, "ffn.out")
        acted = {s for s, f in preds if f & ACT}
        for s, f in preds:
            if s in consumed:  # the middle of a longer chain: both consumes and is consumed
                role[s] = "ffn.in" if role.get(s) in (None, "ffn.out") else role[s]
            else:
                role[s] = "ffn.gate" if (s in acted and len(acted) < len(preds)) else "ffn.in"
            if not f:
                chains.append((s, out_name))
    # A projection no other consumes, beside FFN projections in the same module (a mixture-of-experts layer's
    # shared-expert gate, sigmoid(gate(x)) * shared_expert(x)): part of that FFN.
    ffn_parents = {n.rpartition(".")[0] for n, r in role.items() if r.startswith("ffn")}
    for n in tr.linear_in:
        parent = n.rpartition(".")[0]
        if n not in role and parent and any(p == parent or p.startswith(parent + ".") for p in ffn_parents):
            role[n] = "ffn.gate"
    return role, chains


def _mha_rows(name: str, m: nn.MultiheadAttention, tr: _Tracer, role: dict, seen: set) -> list[ModuleUse]:
    """nn.MultiheadAttention's own parameters as q, k, v rows (in_proj split, biases with their matrix)."""
    E = m.embed_dim
    if m.in_proj_weight is not None:
        key = qualified(name, "in_proj_weight")
        mats = {"q": E * E, "k": E * E, "v": E * E}
        first = m.in_proj_weight
    else:
        key = qualified(name, "q_proj_weight")
        mats = {"q": m.q_proj_weight.numel(), "k": m.k_proj_weight.numel(), "v": m.v_proj_weight.numel()}
        first = m.q_proj_weight
    if id(first) in seen:
        return []
    for p in m.parameters(recurse=False):
        seen.add(id(p))
    extra = {"q": 0, "k": 0, "v": 0}
    if m.in_proj_bias is not None:
        extra = {k: E for k in extra}
    for k, b in (("k", m.bias_k), ("v", m.bias_v)):
        if b is not None:
            extra[k] += b.numel()
    used = key in role
    flops = tr.flops.get(key, 0)
    total_mats = sum(mats.values())
    return [ModuleUse(f"{name}.{k}", f"attn.{k}" if used else "other", mats[k] + extra[k], mats[k], tr.out_shape.get(key),
                      flops * mats[k] // total_mats) for k in ("q", "k", "v")]


def trace(module: nn.Module, call, x: torch.Tensor, d_model: int) -> Dataflow:
    """One eval-mode, grad-enabled forward of call(x) under the tracer (grad keeps MHA off its fused fast path)."""
    norms = find_norms(module, d_model, x.device, x.dtype)
    tr = _Tracer(module, d_model)
    hooks = []
    for name, m in module.named_modules():
        if norms.get(name) == d_model:  # a norm of the residual stream; per-head norms keep q as q
            tr.stream_norms = True
            hooks.append(m.register_forward_hook(lambda _m, a, o: tr.norm_out(a[0] if a else None, o)))
        hooks.append(m.register_forward_pre_hook(lambda _m, _a, _n=name: tr.module_stack.append(_n)))
        hooks.append(m.register_forward_hook(lambda _m, _a, o, _n=name: tr.leave(_n, o)))
    try:
        with train_mode(module, False), torch.enable_grad(), tr:
            out = call(x)
    finally:
        for h in hooks:
            h.remove()
    role, chains = assign_roles(tr)
    modules = []
    seen: set[int] = set()
    for name, m in module.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            modules.extend(_mha_rows(name, m, tr, role, seen))
            continue
        if owns_several_matrices(m):  # bare matrices: a row each, named by the parameter
            for pn, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                key = qualified(name, pn)
                modules.append(ModuleUse(key, role.get(key, "other"), p.numel(), p.numel() if p.ndim >= 2 else 0,
                                         tr.out_shape.get(key), tr.flops.get(key, 0)))
            continue
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for p in own)
        in_norm = any(name == n or name.startswith(n + ".") for n in norms)
        r = "norm" if in_norm else "attn.out" if name in tr.mha_out else role.get(name, "other")
        modules.append(ModuleUse(name or "(root)", r, sum(p.numel() for p in own), sum(p.numel() for p in own if p.ndim >= 2),
                                 tr.out_shape.get(name), tr.flops.get(name, 0)))
    total = sum(p.numel() for p in module.parameters())
    assert sum(m.params for m in modules) == total, (sum(m.params for m in modules), total)
    tokens = x.shape[0] * x.shape[1] if x.ndim >= 2 else 1
    def normed(n: str, depth: int = 0) -> bool:  # a low-rank chain reads what its first projection reads
        src = tr.linear_in.get(n, {})
        return "@norm" in src or (depth < 3 and any(normed(s, depth + 1) for s in src if s in tr.linear_in and s != n))
    queries = sorted({q for c in tr.attention for q in c.q if q in tr.linear_in})
    ffn_ins = sorted(n for n, r in role.items() if r in ("ffn.in", "ffn.gate"))
    split_kv = sorted({n for c in tr.attention if c.q and all(normed(q) for q in c.q if q in tr.linear_in)
                       for n in c.k + c.v if n in tr.linear_in and not normed(n)})
    placement = (tr.stream_norms, tuple(q for q in queries if not normed(q)), tuple(n for n in ffn_ins if not normed(n)),
                 tuple(split_kv + tr.split_streams), tr.get(out) == {"@norm": 0})
    return Dataflow(tuple(modules), tuple(tr.attention), tuple(chains), tokens, total, *placement, norms)
