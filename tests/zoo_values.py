"""Positions that reach attention's values: a rotary table applied to v as well as q and k (relative.values_positioned);
and correct blocks whose values carry no positions though their outputs vary along identical tokens: a sink logit in
the softmax's denominator (gpt-oss), whose weights sum below 1."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


class ValuesRotated(TrainBlock):
    """v rotated by the same table as q and k: each value then carries its key's absolute position into the output
    (a port that mapped the rotary over all three projections). The scores stay a function of i - j."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = self.rotary(q), self.rotary(k), self.rotary(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class SinkLogits(TrainBlock):
    """Correct: a learned sink logit per head joins each row of scores and is dropped after the softmax (gpt-oss)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        T = h.shape[1]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        sink = self.sinks.view(1, -1, 1, 1).expand(s.shape[0], -1, T, 1)
        p = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        return self.o_proj(merge(F.dropout(p, self.p, self.training) @ v))


class EinsumValuesHeadsAfterTokens(TrainBlock):
    """Correct: written-out attention whose values stay (B, T, H, E) into an einsum: their key axis is not -2, so with
    as many heads as tokens the heads would read as positions if the layout were assumed."""

    def attention(self, h):
        B, T, C = h.shape
        q, k = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj))
        q, k = self.rotary(q), self.rotary(k)
        v = self.v_proj(h).view(B, T, self.n_heads, C // self.n_heads)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        y = torch.einsum("bhij,bjhd->bihd", F.dropout(s.softmax(-1), self.p, self.training), v)
        return self.o_proj(y.reshape(B, T, C))


PLANTED = {"ValuesRotated": "relative.values_positioned"}
CORRECT = ["SinkLogits", "EinsumValuesHeadsAfterTokens"]
