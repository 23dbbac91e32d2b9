"""Attention calls: each one recorded as an AttentionCall, whether torch hands it over whole (F.scaled_dot_product_attention,
nn.MultiheadAttention's F.multi_head_attention_forward) or it is written out (a softmax over a product of two activations,
multiplied into a third)."""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from tblock_cli.anatomy.attention import (
    WEIGHT_SUM_TOL,
    AttentionCall,
    Captured,
    ScaleNote,
    apply_masks,
    is_distribution,
    is_sub_distribution,
    qk_std,
    reweighting,
    rms,
    row_centred,
    rows_spread,
    score_stats,
    sdpa_signature,
    self_masked,
    sigmoid_of,
    uniform_rows,
    unit_rows,
)
from tblock_cli.anatomy.counts import Counts
from tblock_cli.anatomy.mha import MHACall
from tblock_cli.anatomy.provenance import NONLINEAR, NORM, Attn, Probs, Product, Provenance


class AttentionRecorder:
    """The attention calls of one forward, in order. Reads provenance (which projections reach q, k and v) and adds the
    calls' markers to it; counts nn.MultiheadAttention's projections, which run inside the call. capture: keep each
    call's scores (biases, masks in) and q.k product, and per projection whether its input rows were equal."""

    def __init__(self, prov: Provenance, counts: Counts, stack: list[str], capture: bool = False):
        self.prov, self.counts, self.stack = prov, counts, stack  # stack[-1]: the module running now
        self.calls: list[AttentionCall] = []
        self.scores: dict[Product, tuple] = {}  # marker -> (A, B, q.k part) of a product of two activations
        self.probs: dict[Probs, int] = {}  # marker -> index into self.calls
        self.probs_out: dict[Probs, torch.Tensor] = {}  # marker -> the softmax's output (a reference, not a copy)
        self.origin: dict[int, tuple[str, Product]] = {}  # index of a written-out call -> ("softmax" | "weights", its product)
        self.mha_out: set[str] = set()
        self.capture = capture
        self.captured: dict[int, Captured] = {}  # index of the attention call (recorded just before it) -> its scores
        self.uniform_in: dict[str, bool] = {}  # identical tokens: False where positions entered before the projection
        # the probe input's tokens, where known: weights over something else (hyper-connections' streams) attend to none
        self.tokens: int | None = None
        self.contracted: dict[Product, int | None] = {}  # a product's contracted axis size, where laid out as a matmul

    def projection_input(self, proj: str, x) -> None:
        if self.capture and isinstance(x, torch.Tensor) and x.ndim >= 2:
            self.uniform_in[proj] = self.uniform_in.get(proj, True) and uniform_rows(x)

    def add(self, call: AttentionCall, out) -> None:
        """A whole call: its output is the call's."""
        self.calls.append(call)
        self.prov.put(out, {Attn(len(self.calls) - 1): 0})

    def keep_scores(self, logits: torch.Tensor, product: torch.Tensor | None, values: torch.Tensor | None = None) -> None:
        if self.capture:
            spread = rows_spread(values) if isinstance(values, torch.Tensor) and values.ndim >= 2 else None
            self.captured[len(self.calls)] = Captured(logits.detach().double().cpu(), product, spread)

    def qk_ratio(self, logits: torch.Tensor, product: torch.Tensor, q, k) -> tuple[float | None, ScaleNote]:
        """The scale judged on q.k alone (an additive position bias does not count): (ratio, note)."""
        std = qk_std(logits, product)
        if std is None:  # the heads' products mixed before the softmax (talking heads): no one scale to judge
            return None, ScaleNote("mixed")
        return self.scale_ratio(std, q, k)

    def scale_ratio(self, logit_std: float, q: torch.Tensor, k: torch.Tensor) -> tuple[float | None, ScaleNote]:
        """logit std / (rms(q) rms(k)) for q and k as they reach the product, with any scalar factor applied to
        them on the way undone: 1 for a 1/sqrt(d_head) scale (after the product or folded into q), sqrt(d_head) without."""
        rq, rk = rms(q), rms(k)
        if rq == 0 or rk == 0:
            return None, ScaleNote("zero")
        if unit_rows(q, k):  # cosine attention: its scale is a temperature
            return None, ScaleNote("cosine")
        folded = self.prov.folded(q, k)
        return logit_std * folded / (rq * rk), ScaleNote("qk", folded, qk_std=logit_std)

    def cached_width(self, t: torch.Tensor, seen: int) -> int:
        """Elements per token a cache keeps for keys (or values) t: the width of the one projection they come from
        when that is smaller than what reaches the product (grouped-query heads repeated by repeat_kv; a fused qkv
        projection is wider and keeps `seen`)."""
        seen = seen * distinct_heads(t) // t.shape[1] if t.ndim == 4 and t.shape[1] > 1 else seen
        src = self.prov.sources(t)
        shape = self.counts.out_shape.get(src[0]) if len(src) == 1 else None
        return min(seen, shape[-1]) if shape else seen

    # ---------------------------------------------------------------- calls torch hands over whole
    def sdpa(self, args, kwargs, out) -> None:
        """An F.scaled_dot_product_attention call: its scores recomputed in float64, statistics, roles of q, k, v."""
        sig = inspect.signature(sdpa_signature)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        q, k, v = a["query"], a["key"], a["value"]
        E = q.shape[-1]
        scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(E)
        if k.ndim == 4 and q.ndim == 4 and k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1] == 0:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        product = (q.detach().double() @ k.detach().double().transpose(-2, -1)) * scale
        logits = apply_masks(product, a["attn_mask"], a["is_causal"])
        std, ent, mp = score_stats(logits)
        ratio, note = self.qk_ratio(logits, product, q, k)
        self.keep_scores(logits, product, v)
        note = replace(note, sdpa=True, passed=a["scale"])
        L, S = q.shape[-2], k.shape[-2]
        heads = q.shape[1] if q.ndim == 4 else 1
        batch = q.shape[0] if q.ndim >= 3 else 1
        flops = 2 * (q.numel() // E) * S * E + 2 * (q.numel() // E) * S * v.shape[-1]
        kv_width = self.cached_width(a["key"], a["key"].numel() // max(1, batch * S)) + \
            self.cached_width(v, v.numel() // max(1, batch * S))
        sources = self.prov.sources
        self.add(AttentionCall(
            kind="scaled_dot_product_attention", where=self.stack[-1], q=sources(a["query"]), k=sources(a["key"]),
            v=sources(v), heads=heads, head_dim=E, batch=batch, q_len=L, k_len=S, logit_std=std, entropy=ent,
            max_prob=mp, scale_ratio=ratio, scale_note=note, flops=flops, kv_width=kv_width, key_axis=True,
            self_masked=self_masked(logits)), out)

    def mha(self, args, kwargs, out) -> None:
        """An nn.MultiheadAttention call (F.multi_head_attention_forward), taken apart by MHACall: scores, q/k/v/out rows."""
        prov = self.prov
        call = MHACall.of(args, kwargs)
        a = call.args
        query, key = a["query"], a["key"]
        H, E = call.heads, call.embed_dim
        dh = E // H
        w = a["in_proj_weight"]
        owner = prov.owner.get(id(w if w is not None else a["q_proj_weight"]), "")
        mha_name = owner.rsplit(".", 1)[0] if "." in owner else ""
        wq, wk, wv = call.weights()
        bq, bk, _ = call.biases()
        batched = call.batched
        qq = query if batched else query[:, None]
        kk = key if batched else key[:, None]
        L, B, S = qq.shape[0], qq.shape[1], kk.shape[0]
        q = F.linear(qq.detach().double(), wq.detach().double(), None if bq is None else bq.detach().double())
        k = F.linear(kk.detach().double(), wk.detach().double(), None if bk is None else bk.detach().double())
        q = q.reshape(L, B * H, dh).transpose(0, 1)
        k = k.reshape(S, B * H, dh).transpose(0, 1)
        logits = (q @ k.transpose(1, 2) / math.sqrt(dh)).reshape(B, H, L, S)
        blocked = call.blocked(B, L, S, logits.device)  # float masks count as masks where below MASKED_LOGIT, not as biases
        if blocked is not None:
            logits = logits.masked_fill(blocked, float("-inf"))
        std, ent, mp = score_stats(logits)
        self.keep_scores(logits, logits)
        if self.capture:
            for n, t in ((owner or "in_proj", query), (owner or "in_proj", key)):
                self.uniform_in[n] = self.uniform_in.get(n, True) and uniform_rows(t)
        rq, rk = rms(q), rms(k)
        ratio = std / (rq * rk) if rq and rk else None
        flops = 4 * B * H * L * S * dh
        roles = (owner,) if owner else ()
        sep = a["use_separate_proj_weight"]
        qn = (prov.owner.get(id(a["q_proj_weight"]), ""),) if sep else roles
        kn = (prov.owner.get(id(a["k_proj_weight"]), ""),) if sep else roles
        vn = (prov.owner.get(id(a["v_proj_weight"]), ""),) if sep else roles
        self.calls.append(AttentionCall(
            kind="nn.MultiheadAttention", where=mha_name, q=qn, k=kn, v=vn, heads=H, head_dim=dh, batch=B, q_len=L,
            k_len=S, logit_std=std, entropy=ent, max_prob=mp, scale_ratio=ratio,
            scale_note=ScaleNote("mha"), flops=flops, kv_width=2 * E,
            key_axis=True, self_masked=self_masked(logits)))
        in_flops = 2 * (L * B) * (wq.numel()) + 2 * (S * B) * (wk.numel() + wv.numel())
        shape = (B, L, E) if batched else (L, E)
        for n in set(qn + kn + vn):
            self.counts.add(n, in_flops // max(1, len(set(qn + kn + vn))), shape)
        out_w = a["out_proj_weight"]
        out_name = prov.owner.get(id(out_w), f"{mha_name}.out_proj")
        self.counts.add(out_name, 2 * L * B * out_w.numel(), shape)
        self.mha_out.add(out_name)
        prov.linear_in[out_name] = {Attn(len(self.calls) - 1): 0}
        if owner:  # the in-projection reads the query (and key, value) stream
            prov.linear_in.setdefault(owner, prov.union(prov.get(t) for t in (query, key, a["value"])))
        # keys and values over a constant (a learned context) read no stream, unless the input was not followed at all
        kv = [t for t in (key, a["value"]) if prov.is_live(t) or not prov.is_live(query)]
        if NORM in prov.get(query) and not all(NORM in prov.get(t) for t in kv):
            prov.split_streams.append(mha_name or "(root)")
        prov.put(out, {out_name: 0})

    # ---------------------------------------------------------------- attention written out
    def matmul(self, a: torch.Tensor, b: torch.Tensor, out, product: torch.Tensor | None = None) -> None:
        """A product of two activations: weights times values (a call's end), or scores (perhaps q.k). product: the
        q.k part of out, where out adds more (baddbmm's input, bloom's ALiBi biases)."""
        prov = self.prov
        probs = [k for k in prov.get(a) if k in self.probs] + [k for k in prov.get(b) if k in self.probs]
        if probs:  # the weighted sum: attention weights times values
            i = self.probs[probs[0]]
            w, other = (a, b) if probs[0] in prov.get(a) else (b, a)
            call = self.calls[i]
            if call.normalised and reshaped_after_softmax(w):  # a bias added to the probabilities, say
                call = replace(call, normalised=False)
            elif call.normalised and (p := self.probs_out.get(probs[0])) is not None and w is not p:
                call = replace(call, reweighted=reweighting(w, p))
            mix = 2 * other.numel() * call.q_len  # (..., S, d_v) values, each weighted for L queries
            v_width = self.cached_width(other, other.numel() // max(1, call.batch * call.k_len))
            self.calls[i] = replace(call, v=prov.sources(other), flops=call.flops + mix, kv_width=call.kv_width + v_width)
            prov.put(out, {Attn(i): 0})
            return
        scored = [t for t in (a, b) if any(k in self.scores for k in prov.get(t))]
        if scored:  # weights derived from a q.k product, multiplied into values without torch's softmax
            w = scored[0]
            self.weights_call(w, b if w is a else a, next(k for k in prov.get(w) if k in self.scores), out)
            return
        marker = Product(len(self.scores))
        self.scores[marker] = (a, b, out if product is None else product)
        matmul_like = a.ndim >= 2 and b.ndim >= 2 and a.shape[-1] == b.shape[-2] and isinstance(out, torch.Tensor) \
            and tuple(out.shape[-2:]) == (a.shape[-2], b.shape[-1])
        self.contracted[marker] = a.shape[-1] if matmul_like else None
        prov.put(out, {**prov.union((prov.get(a), prov.get(b)), NONLINEAR), marker: 0})

    def weights_call(self, w: torch.Tensor, values: torch.Tensor, marker: Product, out) -> None:
        """Attention whose weights came from a q.k product by other means than softmax: a softmax written out
        (rows non-negative, summing to 1), or none at all (raw scores times values)."""
        q, k, product = self.scores[marker]
        if self.tokens is not None and w.ndim >= 2 and self.tokens not in w.shape[-2:] \
                and (w.shape[-1] != w.shape[-2] or self.contracted.get(marker) == self.tokens):
            # weights over no token axis: a mix of residual streams (hyper-connections, not square), k^T v of linear
            # attention (a sum over the tokens). Square weights of another length stay: windows, tokens beside registers
            self.prov.put(out, self.prov.union((self.prov.get(w), self.prov.get(values)), NONLINEAR))
            return
        W = w.detach().double()
        # a sink in the denominator (rows below 1) is still a softmax; sigmoid attention's rows may sum below 1 too
        normalised = is_distribution(W) or (is_sub_distribution(W) and not sigmoid_of(W, product))
        L, S = W.shape[-2], W.shape[-1]
        if normalised:
            logits = torch.log(W).masked_fill(W <= 0, float("-inf"))
            valid = torch.isfinite(logits)
            centred = row_centred(logits, valid).masked_fill(~valid, float("-inf"))  # log W is the logits up to a row's constant
            std, ent, mp = score_stats(centred)
            ratio, note = self.qk_ratio(centred, row_centred(product, valid), q, k) \
                if product.shape[-2:] == W.shape[-2:] else self.scale_ratio(std, q, k)
            self.keep_scores(centred, product)
        else:
            std, ent, mp = score_stats(W)
            ratio, note = None, ScaleNote("no_softmax")
            self.keep_scores(W, None)
        batch = W.shape[0] if W.ndim >= 3 else 1
        heads = W.shape[1] if W.ndim == 4 else 1
        e = q.shape[-1] if q.ndim >= 2 else 1
        flops = 2 * (W.numel() // max(1, S)) * S * e + 2 * values.numel() * L
        kv = self.cached_width(k, k.numel() // max(1, batch * S)) + self.cached_width(values, values.numel() // max(1, batch * S))
        sources = self.prov.sources
        self.origin[len(self.calls)] = ("weights", marker)
        self.add(AttentionCall(
            kind="weights written out" if normalised else "no softmax", where=self.stack[-1], q=sources(q),
            k=sources(k), v=sources(values), heads=heads, head_dim=e, batch=batch, q_len=L, k_len=S,
            logit_std=std, entropy=ent, max_prob=mp, scale_ratio=ratio, scale_note=note, flops=flops, kv_width=kv,
            key_axis=True, self_masked=self_masked(W.log() if normalised else W), normalised=normalised,
            gated=not normalised and sigmoid_of(W, product)), out)

    def softmax(self, args, kwargs, out, ins) -> None:
        """A softmax: over scores, a call's weights (its values come with the next product); otherwise a nonlinearity."""
        prov = self.prov
        x = args[0]
        markers = [k for k in prov.get(x) if k in self.scores]
        if not markers or x.ndim < 2:
            prov.flow(ins, out, NONLINEAR)
            return
        a, b, product = self.scores[markers[-1]]
        # (..., L, E) x (..., E, S): q rows are a's, keys are b's columns (or einsum's second operand).
        heads = x.shape[1] if x.ndim == 4 else 1
        std, ent, mp = score_stats(x)
        if isinstance(product, torch.Tensor) and product.shape[-2:] == x.shape[-2:]:
            ratio, note = self.qk_ratio(x, product, a, b)
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
        axis = "key" if key_axis else softmax_axis(dim % x.ndim, x.ndim)
        self.origin[len(self.calls)] = ("softmax", markers[-1])
        self.calls.append(AttentionCall(
            kind="softmax(QK^T)V", where=self.stack[-1], q=prov.sources(a), k=prov.sources(b), v=(), heads=heads,
            head_dim=e, batch=batch, q_len=L, k_len=S, logit_std=std, entropy=ent, max_prob=mp, scale_ratio=ratio,
            scale_note=note, flops=flops, kv_width=k_width, key_axis=key_axis, axis=axis, self_masked=self_masked(x)))
        marker = Probs(len(self.calls) - 1)
        self.probs[marker] = len(self.calls) - 1
        if isinstance(out, torch.Tensor):
            self.probs_out[marker] = out
        prov.put(out, {marker: 0})


def distinct_heads(t: torch.Tensor) -> int:
    """How many of t's heads (axis 1 of (B, H, ...)) differ: grouped-query keys and values repeated to every query head
    (repeat_interleave, repeat_kv's expand and reshape, a tiling) are exact copies, and a cache keeps one of each.
    Counts H where H does not divide evenly into the groups found (heads that merely coincide)."""
    H = t.shape[1]
    rows = t.detach().transpose(0, 1).reshape(H, -1)
    groups = torch.unique(rows, dim=0).shape[0]
    return groups if H % groups == 0 else H


def reshaped_after_softmax(w: torch.Tensor) -> bool:
    """Whether the weights a softmax's output became before they reach the values have row sums that vary within a
    head and either negative entries or rows above 1: something added after the softmax (a bias on the probabilities).
    A dropout (eval: none), a mask zeroing rows, sinks sliced off (rows under 1, non-negative), a mix of heads or a
    difference of two softmaxes (differential attention: every row 1 - lambda) keep one of the two."""
    if w.ndim < 2 or not w.is_floating_point():
        return False
    W = w.detach().double()
    rows = W.sum(-1)
    if not (bool((W < -1e-6).any()) or bool((rows > 1 + WEIGHT_SUM_TOL).any())):
        return False
    live = rows.abs() > 1e-6
    spread = (rows.masked_fill(~live, -math.inf).amax(-1) - rows.masked_fill(~live, math.inf).amin(-1))
    return bool((spread[live.any(-1)] > WEIGHT_SUM_TOL).any())



def softmax_axis(dim: int, ndim: int) -> str:
    """What a softmax over axis `dim` of ndim-dimensional scores (..., L, S) normalises, other than the keys."""
    if dim == ndim - 2:
        return "query"
    if ndim == 4 and dim == 1:
        return "head"
    return "batch" if dim == 0 else f"axis {dim} of {ndim}"
