"""Norms in half precision, offset norms, a hand-written LayerNorm (and one whose variance cancels under a large
mean), gains that act before a norm's statistics or on
rotated q/k channels, biases added to rotated q and k: the bugs the norms and relative checks catch, and their twins."""

import math

import torch
import torch.nn as nn
from zoo_correct import Good, UpcastRMSNorm, heads, merge
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


class HandLayerNorm(nn.Module):
    """LayerNorm written out: (x - mean) / sqrt(var + eps) * w + b, the variance biased (divided by n) as torch's."""

    unbiased = False

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps, self.weight, self.bias = eps, nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = x.float()  # statistics in float32 at least: a half square overflows above |x| ~ 256
        c = h - h.mean(-1, keepdim=True)
        y = c / torch.sqrt(c.pow(2).sum(-1, keepdim=True) / (x.shape[-1] - self.unbiased) + self.eps)
        return (y * self.weight.float() + self.bias.float()).to(x.dtype)


class GainTwiceLayerNorm(HandLayerNorm):
    """The gain multiplied in twice ((y * w) * w + b): the same function at unit gain, w^2 once trained."""

    def forward(self, x):
        h = x.float()
        c = h - h.mean(-1, keepdim=True)
        y = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight * self.weight + self.bias).to(x.dtype)


class BertLayerNorm(HandLayerNorm):
    """The TF-style LayerNorm of the first BERT ports, eps 1e-12 inside the root, computed in the input's dtype: in
    float16 the eps is 0 and a constant token gives 0 / 0."""

    def __init__(self, d, eps=1e-12):
        super().__init__(d, eps)

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + self.eps)) + self.bias


class HandLayerNormBlock(Good):
    """Good with both norms written out (twin)."""

    norm = HandLayerNorm

    def __init__(self, d_model=64, *a, **k):
        super().__init__(d_model, *a, **k)
        self.ln1, self.ln2 = self.norm(d_model), self.norm(d_model)


class UnbiasedLayerNorm(HandLayerNorm):
    unbiased = True  # bug: x.var()'s n - 1: every token comes out sqrt((n - 1) / n) short of RMS 1


class UnbiasedVarianceNorm(HandLayerNormBlock):
    norm = UnbiasedLayerNorm


class OnePassLayerNorm(HandLayerNorm):
    """The variance in one pass, E[x^2] - E[x]^2 (a fused kernel's shortcut): exact in real numbers, and in float32 it
    loses every digit of a token's spread once its mean is ~1e3x that spread (a stream's massive activations)."""

    def forward(self, x):
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        var = (h.pow(2).mean(-1, keepdim=True) - mean.pow(2)).clamp_min(0)  # bug: cancels under a large mean
        return ((h - mean) * torch.rsqrt(var + self.eps) * self.weight.float() + self.bias.float()).to(x.dtype)


class OnePassVarianceNorm(HandLayerNormBlock):
    norm = OnePassLayerNorm


class GainFirstRMSNorm(UpcastRMSNorm):
    def normed(self, x):
        h = x.float() * (self.offset + self.weight.float())  # bug: the gain before the statistics, which it then cancels
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class GainBeforeStatistics(Rel3):
    """Rel3 whose RMSNorms scale before they normalise: the same at unit gain, another function once trained."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.attn_norm, self.ffn_norm = GainFirstRMSNorm(d_model), GainFirstRMSNorm(d_model)


class QKNormBeforeRotary(Rel3):
    """Per-head RMSNorms on q and k, then the rotation (Qwen3, OLMo-2, Gemma 3): twin."""

    rotate_first = False

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.q_norm, self.k_norm = UpcastRMSNorm(self.hd), UpcastRMSNorm(self.hd)

    def attention(self, h, pad_mask):
        B, T, _ = h.shape
        q, k, v = heads(self.q_proj(h), self.n), heads(self.k_proj(h), self.n), heads(self.v_proj(h), self.n)
        pos = self.positions(pad_mask, B, T, h.device)
        if self.rotate_first:
            q, k = self.q_norm(self.rotate(q, pos)), self.k_norm(self.rotate(k, pos))
        else:
            q, k = self.rotate(self.q_norm(q), pos), self.rotate(self.k_norm(k), pos)
        return self.o_proj(merge(self.attend(q, k, v, self.allowed(B, T, pad_mask, h.device))))


class QKNormAfterRotary(QKNormBeforeRotary):
    rotate_first = True  # bug: the per-channel gains act on rotated channels: scores depend on i, not only i - j


class QKBiasBeforeRotary(Rel3):
    """Qwen2's biased q/k projections, rotated after the bias: twin."""

    bias_first = True

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.q_bias, self.k_bias = nn.Parameter(torch.zeros(d_model)), nn.Parameter(torch.zeros(d_model))

    def attention(self, h, pad_mask):
        B, T, _ = h.shape
        q, k, v = heads(self.q_proj(h), self.n), heads(self.k_proj(h), self.n), heads(self.v_proj(h), self.n)
        qb, kb = heads(self.q_bias.expand(1, 1, -1), self.n), heads(self.k_bias.expand(1, 1, -1), self.n)
        pos = self.positions(pad_mask, B, T, h.device)
        if self.bias_first:
            q, k = self.rotate(q + qb, pos), self.rotate(k + kb, pos)
        else:
            q, k = self.rotate(q, pos) + qb, self.rotate(k, pos) + kb
        return self.o_proj(merge(self.attend(q, k, v, self.allowed(B, T, pad_mask, h.device))))


class QKBiasAfterRotary(QKBiasBeforeRotary):
    bias_first = False  # bug: the biases added to rotated q and k: their products with the rotated keys depend on j


class LengthTemperature(Rel3):
    """A per-head softmax temperature that grows with the query's position, t_h = 1 + b_h log(1 + i), b_h = 0 at init
    (scalable softmax, SSMax; Mistral Large 3 keeps one): rows scaled by design, per head, not per channel: twin."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.temperature = nn.Parameter(torch.zeros(n_heads))

    def attend(self, q, k, v, allowed):
        T = q.shape[-2]
        rows = torch.log1p(torch.arange(T, device=q.device, dtype=q.dtype))[:, None]
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd) * (1 + self.temperature[:, None, None] * rows)
        return self.softmax(self.fill(s, allowed)) @ v


class GainAppliedTwice(HandLayerNormBlock):
    norm = GainTwiceLayerNorm


class EpsVanishesInHalf(HandLayerNormBlock):
    norm = BertLayerNorm
