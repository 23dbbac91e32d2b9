"""The two attention calls torch hands over whole, recorded on the tracer: F.scaled_dot_product_attention and
nn.MultiheadAttention's F.multi_head_attention_forward (`self` is the Tracer)."""

from __future__ import annotations

import inspect
import math

import torch.nn.functional as F

from tblock_cli.anatomy.attention import (
    AttentionCall,
    apply_masks,
    rms,
    score_stats,
    sdpa_signature,
    self_masked,
    uniform_rows,
)
from tblock_cli.anatomy.mha import MHACall
from tblock_cli.anatomy.provenance import NORM, Attn


def record_sdpa(self, args, kwargs, out) -> None:
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
    ratio, note, _ = self.qk_ratio(logits, product, q, k)
    self.keep_scores(logits, product)
    note += "; scale " + (f"{a['scale']:.4g} passed" if a["scale"] is not None else "1/sqrt(E) by default")
    L, S = q.shape[-2], k.shape[-2]
    heads = q.shape[1] if q.ndim == 4 else 1
    batch = q.shape[0] if q.ndim >= 3 else 1
    flops = 2 * (q.numel() // E) * S * E + 2 * (q.numel() // E) * S * v.shape[-1]
    kv_width = self.cached_width(a["key"], a["key"].numel() // max(1, batch * S)) + \
        self.cached_width(v, v.numel() // max(1, batch * S))
    self.attention.append(AttentionCall(
        kind="scaled_dot_product_attention", where=self.module_stack[-1], q=self.sources(a["query"]),
        k=self.sources(a["key"]), v=self.sources(v), heads=heads, head_dim=E, batch=batch, q_len=L, k_len=S,
        logit_std=std, entropy=ent, max_prob=mp, scale_ratio=ratio, scale_note=note, flops=flops, kv_width=kv_width,
        key_axis=True, self_masked=self_masked(logits)))
    self.put(out, {Attn(len(self.attention) - 1): 0})

def record_mha(self, args, kwargs, out) -> None:
    """An nn.MultiheadAttention call (F.multi_head_attention_forward), taken apart by MHACall: scores, q/k/v/out rows."""
    call = MHACall.of(args, kwargs)
    a = call.args
    query, key = a["query"], a["key"]
    H, E = call.heads, call.embed_dim
    dh = E // H
    w = a["in_proj_weight"]
    owner = self.owner.get(id(w if w is not None else a["q_proj_weight"]), "")
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
    qn = (self.owner.get(id(a["q_proj_weight"]), ""),) if sep else roles
    kn = (self.owner.get(id(a["k_proj_weight"]), ""),) if sep else roles
    vn = (self.owner.get(id(a["v_proj_weight"]), ""),) if sep else roles
    self.attention.append(AttentionCall(
        kind="nn.MultiheadAttention", where=mha_name, q=qn, k=kn, v=vn, heads=H, head_dim=dh, batch=B, q_len=L, k_len=S,
        logit_std=std, entropy=ent, max_prob=mp, scale_ratio=ratio,
        scale_note="scale 1/sqrt(d_head), built into nn.MultiheadAttention", flops=flops, kv_width=2 * E, key_axis=True,
        self_masked=self_masked(logits)))
    in_flops = 2 * (L * B) * (wq.numel()) + 2 * (S * B) * (wk.numel() + wv.numel())
    for n in set(qn + kn + vn):
        self.flops[n] = self.flops.get(n, 0) + in_flops // max(1, len(set(qn + kn + vn)))
        self.out_shape[n] = (B, L, E) if batched else (L, E)
    out_w = a["out_proj_weight"]
    out_name = self.owner.get(id(out_w), f"{mha_name}.out_proj")
    self.flops[out_name] = self.flops.get(out_name, 0) + 2 * L * B * out_w.numel()
    self.out_shape[out_name] = (B, L, E) if batched else (L, E)
    self.mha_out.add(out_name)
    self.linear_in[out_name] = {Attn(len(self.attention) - 1): 0}
    if owner:  # the in-projection reads the query (and key, value) stream
        self.linear_in.setdefault(owner, self.union(self.get(t) for t in (query, key, a["value"])))
    if NORM in self.get(query) and not all(NORM in self.get(t) for t in (key, a["value"])):
        self.split_streams.append(mha_name or "(root)")
    self.put(out, {out_name: 0})

