"""Norms in half precision and offset norms: the bugs the norms check catches."""

import torch
import torch.nn as nn
from zoo_correct import UpcastRMSNorm
from zoo_positions import Gemma3, Rel3


class HalfRMSNorm(UpcastRMSNorm):
    def normed(self, x):
        v = x.pow(2).mean(-1, keepdim=True).float()  # bug: squared before the upcast: fp16 overflows above |x| ~ 256
        return (x.float() * torch.rsqrt(v + self.eps) * (self.offset + self.weight.float())).to(x.dtype)


class NormSquaresInHalf(Rel3):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.attn_norm, self.ffn_norm = HalfRMSNorm(d_model), HalfRMSNorm(d_model)


class OffsetNormInitOne(Gemma3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        for norm in (self.attn_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)  # bug: (1 + w) with w = 1: every norm doubles its output
