"""Attention blocks written the way users write them (manual q @ k^T or F.scaled_dot_product_attention, rotary as
rotate-half or as complex numbers, T5-style relative buckets, ALiBi), with a switch per defining number, so the spec
card's attention and position entries can be planted wrong one at a time."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def llama3_freqs(freqs: torch.Tensor, factor: float, low: float, high: float, orig: int) -> torch.Tensor:
    """Meta's llama-3 frequency scaling: fast pairs kept, slow divided by factor, a smooth band between."""
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            s = (orig / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=freqs.dtype)


def t5_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's relative-position bucket of key - query (rel)."""
    ret = 0
    if bidirectional:
        num_buckets //= 2
        ret = (rel > 0).long() * num_buckets
        n = rel.abs()
    else:
        n = -torch.min(rel, torch.zeros_like(rel))
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float().clamp_min(1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(n < max_exact, n, large)


class Attention(nn.Module):
    def __init__(self, d_model=64, n_heads=4, n_kv=None, theta=10000.0, rope=True, rot_dims=None, freq_width=None,
                 pairing="half", llama3=None, apply_scaling=True, scale_x=None, softcap=None, window=None,
                 qk_norm=None, causal=True, sdpa=False, relbias=None, alibi=False, style="matmul", kv_repeat="interleave",
                 table_dtype=None):
        super().__init__()
        self.h, self.kv = n_heads, n_kv or n_heads
        self.e = d_model // n_heads
        self.q = nn.Linear(d_model, self.h * self.e, bias=False)
        self.k = nn.Linear(d_model, self.kv * self.e, bias=False)
        self.v = nn.Linear(d_model, self.kv * self.e, bias=False)
        self.o = nn.Linear(self.h * self.e, d_model, bias=False)
        self.rope, self.pairing = rope, pairing
        self.rot = rot_dims or self.e
        width = freq_width or self.rot  # the bug: frequencies over another width than the rotating one
        freqs = 1.0 / theta ** (torch.arange(0, self.rot, 2, dtype=torch.float64) / width)
        if llama3 is not None:
            scaled = llama3_freqs(freqs, *llama3)
            if apply_scaling:
                freqs = scaled
        self.register_buffer("freqs", freqs, persistent=False)
        self.scale = (scale_x or self.e) ** -0.5
        self.softcap, self.window, self.causal, self.sdpa = softcap, window, causal, sdpa
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.qn, self.kn = nn.RMSNorm(self.e, eps=1e-6), nn.RMSNorm(self.e, eps=1e-6)
        elif qk_norm == "width":
            self.qn, self.kn = nn.RMSNorm(self.h * self.e, eps=1e-6), nn.RMSNorm(self.kv * self.e, eps=1e-6)
        self.relbias = relbias  # None, or whether the buckets tell keys after the query from keys before
        if relbias is not None:
            self.bias = nn.Embedding(32, n_heads)
        self.alibi = alibi
        self.style = style  # matmul: q @ k^T * scale; einsum; fold: q * scale before the product
        self.table_dtype = table_dtype  # cos/sin rounded to this (modded-nanogpt keeps them in bfloat16)
        self.kv_repeat = kv_repeat  # interleave (h reads h // group), tile (h reads h mod kv), gqa (sdpa's enable_gqa)

    def rotate(self, x):  # (B, H, T, E)
        T = x.shape[2]
        ang = torch.arange(T, dtype=self.freqs.dtype)[:, None] * self.freqs[None]  # (T, rot/2)
        r, rest = x[..., : self.rot], x[..., self.rot :]
        if self.pairing == "complex":  # Meta's: interleaved pairs as complex numbers
            z = torch.view_as_complex(r.reshape(*r.shape[:-1], -1, 2).contiguous())
            r = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang).to(z.dtype)).flatten(-2)
        else:
            cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
            if self.table_dtype is not None:
                cos, sin = cos.to(getattr(torch, self.table_dtype)), sin.to(getattr(torch, self.table_dtype))
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
            a, b = r[..., : self.rot // 2], r[..., self.rot // 2 :]
            r = r * cos + torch.cat([-b, a], -1) * sin
        return torch.cat([r, rest], -1)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "width":
            q, k = self.qn(q), self.kn(k)
        q = q.view(B, T, self.h, self.e).transpose(1, 2)
        k = k.view(B, T, self.kv, self.e).transpose(1, 2)
        v = v.view(B, T, self.kv, self.e).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.qn(q), self.kn(k)
        if self.rope:
            q, k = self.rotate(q), self.rotate(k)
        if self.kv_repeat == "tile":
            k, v = k.repeat(1, self.h // self.kv, 1, 1), v.repeat(1, self.h // self.kv, 1, 1)
        elif self.kv_repeat == "interleave":
            k, v = k.repeat_interleave(self.h // self.kv, 1), v.repeat_interleave(self.h // self.kv, 1)
        i = torch.arange(T)
        allowed = torch.ones(T, T, dtype=torch.bool)
        if self.causal:
            allowed &= i[None, :] <= i[:, None]
        if self.window is not None:
            allowed &= (i[:, None] - i[None, :]).abs() < self.window
        if self.sdpa:
            gqa = {"enable_gqa": True} if self.kv_repeat == "gqa" else {}
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, **gqa)
        else:
            if self.style == "einsum":
                s = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
            elif self.style == "fold":
                s = (q * self.scale) @ k.transpose(-2, -1)
            else:
                s = q @ k.transpose(-2, -1) * self.scale
            if self.softcap is not None:
                s = torch.tanh(s / self.softcap) * self.softcap
            if self.relbias is not None:
                s = s + self.bias(t5_bucket(i[None, :] - i[:, None], self.relbias)).permute(2, 0, 1)
            if self.alibi:
                slopes = torch.tensor([2 ** (-8 * (h + 1) / self.h) for h in range(self.h)], dtype=s.dtype)
                s = s - slopes[:, None, None] * (i[:, None] - i[None, :]).abs().to(s.dtype)
            s = s.masked_fill(~allowed, float("-inf"))
            y = s.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); every switch goes to the attention."""

    def __init__(self, d_model=64, n_heads=4, **attention):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads, **attention)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))
