"""The tracer: a TorchFunctionMode that follows provenance through one forward and records projections and attention."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tblock_cli.anatomy.attention import (
    WEIGHT_SUM_TOL,
    AttentionCall,
    qk_std,
    rms,
    score_stats,
    self_masked,
    uniform_rows,
)
from tblock_cli.anatomy.calls import record_mha, record_sdpa
from tblock_cli.anatomy.ops import ACTIVATIONS, LINEAR, MATMULS, NORMS, SCALING, SOFTMAX

# Provenance flags: an activation function acted (gelu, silu, ...), or another nonlinearity did (a
# product of two activations, exp, ...). A projection reached with neither composes linearly.
ACT, NONLINEAR = 1, 2


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


def owns_several_matrices(m: nn.Module) -> bool:
    """nn.MultiheadAttention, or a module holding bare weight matrices: each matrix is a projection of its own."""
    return isinstance(m, nn.MultiheadAttention) or sum(p.ndim >= 2 for p in m.parameters(recurse=False)) > 1


def qualified(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


class Tracer(TorchFunctionMode):
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
        # capture (position probes): per call its scores (biases, masks in) and its q.k product, float64; per
        # projection whether its input rows were equal (identical tokens: False where positions entered before it).
        self.capture = False
        self.captured: dict[int, dict] = {}  # index of the attention call (recorded just before it) -> scores
        self.uniform_in: dict[str, bool] = {}
        self.products: dict[int, tuple[str, str]] = {}  # id(a * b) of two projections' outputs -> their names
        self.act_after_product: list[tuple[str, ...]] = []  # projections multiplied together before an activation
        self.normed_outputs: set[str] = set()  # projections (and "@attnN" calls) whose output a full-width norm reads

    def norm_out(self, args: tuple, out) -> None:
        """A norm module's output: a new start of the residual stream, unless it normalises one projection's output
        (olmo2's full-width q_norm) or an attention output (bitnet's attn_sub_norm): then it stays what it read. A norm
        called with the residual too (Gemma's norm fused with the add: norm(a, x)) normalises the stream."""
        inp = args[0] if len([a for a in args if isinstance(a, torch.Tensor)]) == 1 else None
        if isinstance(inp, torch.Tensor) and (id(inp) in self.proj_outs or any(k.startswith("@attn") for k in self.get(inp))):
            self.normed_outputs.update(self.get(inp))  # a sublayer's output normalised before the add (OLMo-2)
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
        for o in tensors(t):
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
        if name in ("__get__", "__set__") or not any(True for _ in tensors(out)):
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
        ins = [t for t in tensors((args, kwargs))]
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
            if self.capture and isinstance(x, torch.Tensor) and x.ndim >= 2:
                self.uniform_in[proj] = self.uniform_in.get(proj, True) and uniform_rows(x)
            self.out_shape[proj] = tuple(out.shape)
            fan_in = weight.shape[-1] if func is F.linear else weight.shape[-2]
            self.flops[proj] = self.flops.get(proj, 0) + 2 * weight.numel() * (x.numel() // max(1, fan_in))
            self.put(out, {proj: 0})
            self.proj_outs.add(id(out))
        elif func is F.multi_head_attention_forward:
            record_mha(self, args, kwargs, out)
        elif func is F.scaled_dot_product_attention:
            record_sdpa(self, args, kwargs, out)
        elif name in NORMS and func is getattr(F, name, None):
            if out.shape[-1] == self.d_model:  # a norm of the residual stream: a new start for provenance
                self.put(out, {"@norm": 0})
                self.stream_norms = True
            else:  # a per-head (QK) norm: q stays q
                self.put(out, self.union((self.get(t) for t in acts), NONLINEAR))
        elif name in SOFTMAX:
            self.softmax(args, kwargs, out, ins)
        elif name == "baddbmm" and baddbmm_operands(args, kwargs) is not None:
            b1, b2, alpha = baddbmm_operands(args, kwargs)  # input + alpha * b1 @ b2: the q.k part is b1 @ b2 alone
            self.matmul(name, args, [b1, b2], out, product=(b1.detach() @ b2.detach()) * alpha)
        elif name in MATMULS and len(acts) >= 2:
            self.matmul(name, args, acts, out)
        elif name in ACTIVATIONS:
            pair = self.products.get(id(acts[0])) if acts else None
            if pair is not None:
                self.act_after_product.append(pair)
            self.put(out, self.union((self.get(t) for t in acts), ACT))
        elif name in SCALING:
            with_prov = [t for t in acts if self.get(t) or t.numel() > 1]
            flag = NONLINEAR if len([t for t in acts if self.get(t)]) >= 2 else 0
            self.note_product(acts, out)
            self.put(out, self.union((self.get(t) for t in with_prov), flag))
            self.track_scalar(name, args, out)
        elif name in LINEAR:
            self.put(out, self.union(self.get(t) for t in acts))
            if len(acts) == 1 and isinstance(out, torch.Tensor):  # a view or copy keeps the scalar factor
                self.scalar[id(out)] = self.scalar.get(id(acts[0]), 1.0)
        else:
            self.put(out, self.union((self.get(t) for t in acts), NONLINEAR))

    def note_product(self, acts, out) -> None:
        """a * b of two different projections' outputs, neither through an activation yet (a gated FFN's product)."""
        direct = [self.get(t) for t in acts[:2]]
        if len(acts) < 2 or not isinstance(out, torch.Tensor) or not all(len(p) == 1 for p in direct):
            return
        (a, fa), (b, fb) = (next(iter(p.items())) for p in direct)
        if a != b and not a.startswith("@") and not b.startswith("@") and a in self.linear_in and b in self.linear_in \
                and not (fa | fb):
            self.products[id(out)] = (a, b)

    def qk_ratio(self, logits: torch.Tensor, product: torch.Tensor, q, k) -> tuple[float | None, str, float]:
        """The scale judged on q.k alone (an additive position bias does not count): (ratio, note, std of the q.k part)."""
        return (*self.scale_ratio(std := qk_std(logits, product), q, k), std)

    def keep_scores(self, logits: torch.Tensor, product: torch.Tensor | None) -> None:
        if self.capture:
            self.captured[len(self.attention)] = {"logits": logits.detach().double().cpu(), "product": product}

    def matmul(self, name, args, acts, out, product: torch.Tensor | None = None):
        """product: the q.k part of out, where out adds more (baddbmm's input, bloom's ALiBi biases)."""
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
        self.scores[marker] = (a, b, out if product is None else product)
        self.put(out, {**self.union((self.get(a), self.get(b)), NONLINEAR), marker: 0})

    def weights_call(self, w: torch.Tensor, values: torch.Tensor, marker: str, out) -> None:
        """Attention whose weights came from a q.k product by other means than softmax: a softmax written out
        (rows non-negative, summing to 1), or none at all (raw scores times values)."""
        q, k, product = self.scores[marker]
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
            ratio, note, _ = self.qk_ratio(centred.masked_fill(~valid, float("-inf")), product, q, k) \
                if product.shape[-2:] == W.shape[-2:] else (*self.scale_ratio(std, q, k), std)
            self.keep_scores(centred.masked_fill(~valid, float("-inf")), product)
        else:
            std, ent, mp = score_stats(W)
            ratio, note = None, "no softmax: the raw scores weight the values"
            self.keep_scores(W, None)
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
        a, b, product = self.scores[markers[-1]]
        # (..., L, E) x (..., E, S): q rows are a's, keys are b's columns (or einsum's second operand).
        heads = x.shape[1] if x.ndim == 4 else 1
        std, ent, mp = score_stats(x)
        if isinstance(product, torch.Tensor) and product.shape[-2:] == x.shape[-2:]:
            ratio, note, _ = self.qk_ratio(x, product, a, b)
        else:
            ratio, note = self.scale_ratio(std, a, b)
        self.keep_scores(x, product if isinstance(product, torch.Tensor) else None)
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
        rq, rk = rms(q), rms(k)
        if rq == 0 or rk == 0:
            return None, "q or k is zero"
        folded = abs(self.scalar.get(id(q), 1.0) * self.scalar.get(id(k), 1.0))
        note = "the q and k that reach the product" + (f" (a factor {folded:.4g} folded into them)" if folded != 1.0 else "")
        return logit_std * folded / (rq * rk), note


def baddbmm_operands(args, kwargs):
    """(batch1, batch2, alpha) of a baddbmm(input, batch1, batch2, beta=, alpha=) call, given by position or keyword."""
    b1 = kwargs.get("batch1", args[1] if len(args) > 1 else None)
    b2 = kwargs.get("batch2", args[2] if len(args) > 2 else None)
    alpha = kwargs.get("alpha", 1)
    if not (isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor) and isinstance(alpha, (int, float))):
        return None
    return b1, b2, alpha
