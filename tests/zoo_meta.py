"""Blocks in the style of Meta's llama `TransformerBlock` and of a fused-GLU feed-forward, for the role and compare
tests (tests/test_roles_inplace.py).

`MetaBlock` keeps Meta's habits that matter to the tracer: bare `wq`/`wk`/`wv`/`wo` names, grouped-query heads
repeated by expand + reshape, and keys and values written IN PLACE into a per-instance cache tensor and read back
from it (`cache_k[:B, start:start+T] = xk; keys = cache_k[:B, :start+T]`). forward(x) starts at position 0 and builds
its causal mask inside, so `--block tests/zoo_meta.py:MetaBlock` needs no adapter. `rotary="half"` rotates (i, i+hd/2)
as Hugging Face's Llama does (so it equals `hf:llama` with copied weights); `rotary="complex"` rotates pairs
(2i, 2i+1) through complex numbers, as Meta's source does.

`FusedGLU` / `UnfusedGLU`: one function, its gated FFN written with one Linear(d, 2 d_ff) chunked into value and gate
(x-transformers' GLU) or with two projections.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_BATCH, MAX_SEQ = 4, 64
# The GLU's gate activation: GELU (neither odd nor homogeneous), ReLU (homogeneous), tanh (odd), none (bilinear).
GATES = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "none": lambda t: t}


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, theta, rotary, buffer_cache):
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.rotary = n_heads, n_kv_heads, d_model // n_heads, rotary
        self.wq = nn.Linear(d_model, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, d_model, bias=False)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        cache = torch.zeros(MAX_BATCH, MAX_SEQ, n_kv_heads, self.hd)
        if buffer_cache:  # a registered buffer (moves with .to()) or a plain attribute, as Meta's is
            self.register_buffer("cache_k", cache, persistent=False)
            self.register_buffer("cache_v", cache.clone(), persistent=False)
        else:
            self.cache_k, self.cache_v = cache, cache.clone()

    def rope(self, q, k, start):  # (B, T, nh, hd)
        T = q.shape[1]
        freqs = torch.arange(start, start + T).float()[:, None] * self.inv_freq[None]  # (T, hd/2)
        if self.rotary == "complex":
            cis = torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]
            def rot(x):
                xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
                return torch.view_as_real(xc * cis).flatten(3).type_as(x)
            return rot(q), rot(k)
        emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def repeat_kv(self, t):  # (B, S, nkv, hd) -> (B, S, nh, hd): kv head j serves query heads j*g .. j*g+g-1
        B, S, n, hd = t.shape
        g = self.n_heads // n
        return t[:, :, :, None, :].expand(B, S, n, g, hd).reshape(B, S, n * g, hd)

    def forward(self, x, start_pos, mask):
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.hd)
        xk = self.wk(x).view(B, T, self.n_kv, self.hd)
        xv = self.wv(x).view(B, T, self.n_kv, self.hd)
        xq, xk = self.rope(xq, xk, start_pos)
        # Meta's runs under inference_mode; detached, the cache lets the block train (compare's gradients)
        self.cache_k = self.cache_k.detach().to(xq)
        self.cache_v = self.cache_v.detach().to(xq)
        self.cache_k[:B, start_pos:start_pos + T] = xk  # written in place, read back below
        self.cache_v[:B, start_pos:start_pos + T] = xv
        keys = self.repeat_kv(self.cache_k[:B, :start_pos + T])
        values = self.repeat_kv(self.cache_v[:B, :start_pos + T])
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # (B, nh, S, hd)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.hd)
        scores = F.softmax((scores + mask).float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values).transpose(1, 2).contiguous().view(B, T, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    """Meta's TransformerBlock as it computes, at position 0 with its causal mask made inside."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=2, eps=1e-6, theta=10000.0, rotary="half",
                 buffer_cache=False):
        super().__init__()
        self.causal = True
        self.attention = Attention(d_model, n_heads, n_kv_heads or n_heads, theta, rotary, buffer_cache)
        self.feed_forward = FeedForward(d_model, d_ff or 4 * d_model)
        self.attention_norm = RMSNorm(d_model, eps)
        self.ffn_norm = RMSNorm(d_model, eps)

    def forward(self, x):
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1).type_as(x)
        h = x + self.attention(self.attention_norm(x), 0, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaBlockComplex(MetaBlock):
    """Meta's own rotary layout (pairs 2i, 2i+1 through complex numbers)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=2, eps=1e-6, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, eps, rotary="complex", **kw)


class MetaBlockBuffer(MetaBlock):
    """The cache as a registered buffer instead of a plain attribute."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=2, eps=1e-6, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, eps, buffer_cache=True, **kw)


# ----------------------------------------------------------------------------- fused and unfused GLU


class UnfusedGLU(nn.Module):
    """Pre-LN block, SDPA attention, a gated FFN (GELU unless `act` says) with separate value and gate projections."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, gate_first=False, act="gelu"):
        super().__init__()
        self.act = GATES[act]
        self.n_heads, self.d_ff = n_heads, d_ff or 4 * d_model
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.make_ffn(d_model)
        self.ff_out = nn.Linear(self.d_ff, d_model)
        self.gate_first = gate_first

    def make_ffn(self, d_model):
        self.value = nn.Linear(d_model, self.d_ff)
        self.gate = nn.Linear(d_model, self.d_ff)

    def glu(self, h):
        return self.value(h) * self.act(self.gate(h))

    def attn(self, h):
        B, T, C = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ff_out(self.glu(self.ln2(x)))


class FusedGLU(UnfusedGLU):
    """The same FFN through one Linear(d, 2 d_ff): x-transformers' GLU (value first, then gate)."""

    def make_ffn(self, d_model):
        self.proj = nn.Linear(d_model, 2 * self.d_ff)

    def glu(self, h):
        value, gate = self.proj(h).chunk(2, dim=-1)
        if self.gate_first:
            gate, value = value, gate
        return value * self.act(gate)


class FusedGLUGateFirst(FusedGLU):
    """The fused halves the other way round: gate first, then value."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, act="gelu"):
        super().__init__(d_model, n_heads, d_ff, gate_first=True, act=act)


class FusedSwiGLU(nn.Module):
    """A Llama layer as HF's computes it, its SwiGLU gate and up fused into one projection (gate half first)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=2, eps=1e-6, theta=10000.0):
        super().__init__()
        self.causal = True
        self.attention = Attention(d_model, n_heads, n_kv_heads, theta, "half", False)
        self.w13 = nn.Linear(d_model, 2 * (d_ff or 4 * d_model), bias=False)
        self.w2 = nn.Linear(d_ff or 4 * d_model, d_model, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(d_model, eps), RMSNorm(d_model, eps)

    def forward(self, x):
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1).type_as(x)
        h = x + self.attention(self.attention_norm(x), 0, mask)
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)
