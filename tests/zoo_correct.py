"""Correct blocks every check must pass: the seed's block, Llama's, PyTorch's own layers, and the ways people write them
(opaque names, hand-written attention, nesting, GPT-2's Conv1D); each takes tblock's keywords (d_model, n_heads,
d_ff, dropout, causal)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Good(nn.Module):
    """A correct Pre-LN block written out by hand: MHA with need_weights=False, GELU FFN."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.1, causal=False, eps=1e-5):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.causal = causal
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))

    def mask(self, T, device):
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(1) if self.causal else None

    def sa(self, h, pad_mask, need_weights=False):
        return self.attn(h, h, h, key_padding_mask=pad_mask, attn_mask=self.mask(h.shape[1], h.device), need_weights=need_weights)[0]

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(self.ln2(x))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()  # squared in float32, as Llama's: an fp16 square overflows above |x| ~ 256
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LlamaBlock(nn.Module):
    """Llama-style: RMSNorm, SDPA attention (causal), SwiGLU FFN of width 8/3 d, no biases."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        hidden = 256 * math.ceil(int(8 * d_model / 3) / 256) if d_model >= 256 else int(8 * d_model / 3)
        self.attn_norm = RMSNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = RMSNorm(d_model)
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device)
        if self.causal:
            allowed = allowed.tril()
        allowed = allowed[None, None]
        if pad_mask is not None:
            allowed = allowed & ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def TorchPreLN(d_model=64, n_heads=4, d_ff=None, dropout=0.1):
    return nn.TransformerEncoderLayer(d_model, n_heads, d_ff or 4 * d_model, dropout, batch_first=True, norm_first=True)


def TorchPostLN(d_model=64, n_heads=4, d_ff=None, dropout=0.1):
    return nn.TransformerEncoderLayer(d_model, n_heads, d_ff or 4 * d_model, dropout, batch_first=True, norm_first=False)


class NoPadKeyword(nn.Module):
    """Correct, but its forward takes no padding mask: the padding check must skip, not fail."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.inner = Good(d_model, n_heads)

    def forward(self, x):
        return self.inner(x)


# Correct blocks written the ways people write them: opaque names, hand-written attention, nesting,
# GPT-2's Conv1D. Each takes a padding mask under some name (or none) and, where it can, `causal`.


def heads(t, n):  # (B, T, C) -> (B, nh, T, hs)
    B, T, C = t.shape
    return t.view(B, T, n, C // n).transpose(1, 2)


def merge(t):  # (B, nh, T, hs) -> (B, T, C)
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B, T, H * D)


def allowed_mask(T, device, causal, pad_mask=None):
    """(B or 1, 1, T, T) bool, True = may attend."""
    a = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        a = a.tril()
    a = a[None, None]
    if pad_mask is not None:
        a = a & ~pad_mask[:, None, None, :]
    return a


class OpaqueNames(nn.Module):
    """Pre-LN with projections called w_a..w_d, SDPA attention, an MLP called f/g."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=False):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.n, self.causal = n_heads, causal
        self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.w_a, self.w_b, self.w_c, self.w_d = (nn.Linear(d_model, d_model) for _ in range(4))
        self.f, self.g = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))
        x = x + self.w_d(merge(y))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class HandSoftmax(nn.Module):
    """Pre-LN with a fused qkv, softmax(QK^T / sqrt(d_head)) V written out, a ReLU MLP called net."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=False, prescale=False):
        super().__init__()
        self.n, self.causal, self.prescale = n_heads, causal, prescale
        self.norm_a, self.norm_b = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.o = nn.Linear(d_model, d_model)
        self.net = nn.Sequential(nn.Linear(d_model, d_ff or 4 * d_model), nn.ReLU(), nn.Linear(d_ff or 4 * d_model, d_model))

    def scores(self, q, k):
        if self.prescale:
            return (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        return merge(s.softmax(dim=-1) @ v)

    def forward(self, x, mask=None):
        x = x + self.o(self.attend(self.norm_a(x), mask))
        return x + self.net(self.norm_b(x))


def HandSoftmaxPrescaled(d_model=64, n_heads=4, d_ff=None, causal=False):
    """q scaled by d_head^-1/2 before the product (as many code bases do): as correct as scaling after."""
    return HandSoftmax(d_model, n_heads, d_ff, causal, prescale=True)


class XAttention(nn.Module):
    def __init__(self, dim, heads_):
        super().__init__()
        self.heads = heads_
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):  # mask: True = keep (x-transformers' convention)
        q, k, v = (heads(f(x), self.heads) for f in (self.to_q, self.to_k, self.to_v))
        s = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], -torch.finfo(s.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", s.softmax(dim=-1), v)
        return self.to_out(merge(out))


class XFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU()), nn.Dropout(0.0), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class XEncoder(nn.Module):
    """x-transformers' layout: layers = ModuleList of [norm, block] pairs, to_q/to_k/to_v/to_out, mask True = keep."""

    def __init__(self, dim=64, heads=4, depth=1):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), XAttention(dim, heads)]))
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), XFeedForward(dim)]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for norm, fn in self.layers:
            x = x + (fn(norm(x), mask=mask) if isinstance(fn, XAttention) else fn(norm(x)))
        return self.final_norm(x)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a Linear with its weight transposed, computed with addmm."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


class GPT2Style(nn.Module):
    """GPT-2's block: ln_1, c_attn (fused, Conv1D), c_proj, ln_2, mlp.c_fc/c_proj with tanh-GELU; causal."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.n, self.causal = n_heads, causal
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.c_attn, self.c_proj = Conv1D(3 * d_model, d_model), Conv1D(d_model, d_model)
        self.mlp = nn.ModuleDict({"c_fc": Conv1D(4 * d_model, d_model), "c_proj": Conv1D(d_model, 4 * d_model)})

    def forward(self, x, attention_mask=None):  # attention_mask: 1 = keep (HF's convention)
        h = self.ln_1(x)
        q, k, v = (heads(t, self.n) for t in self.c_attn(h).split(x.shape[-1], dim=2))
        pad = None if attention_mask is None else ~attention_mask.bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad))
        x = x + self.c_proj(merge(y))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) of (B, nh, T, hs) queries and keys."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, t):
        T = t.shape[-2]
        # angles in float32 whatever the module's dtype: a bf16 inv_freq holds positions exactly only up to 256
        freqs = torch.outer(torch.arange(T, device=t.device, dtype=torch.float32), self.inv_freq.float())
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class RoPEBlock(LlamaBlock):
    """Llama-style with rotary positions: token order matters by design (order skips: positions inside)."""

    def __init__(self, d_model=64, n_heads=4, causal=False):
        super().__init__(d_model, n_heads, causal)
        self.rotary = Rotary(d_model // n_heads)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask))
        return self.o_proj(merge(y))


class ScaledBeforeRotary(RoPEBlock):
    """q scaled by 1/sqrt(d_head) before its rotation, SDPA called with scale 1 (as several codebases fold the scale):
    the factor is carried through the rotation's products with cos and sin, so the scores count as scaled."""

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q * q.shape[-1] ** -0.5), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask), scale=1.0)
        return self.o_proj(merge(y))


class XKeepMask(XEncoder):
    """x-transformers-style, mask True = keep, padded query rows zeroed: correct with --pad-keyword mask --pad-means keep."""

    def forward(self, x, mask=None):
        out = super().forward(x, mask)
        return out if mask is None else out * mask[..., None]


class QKNorm(LlamaBlock):
    """Per-head RMSNorm on q and k before the product (OLMo-2, Qwen3, Gemma 3): correct, and q/k keep their roles."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.q_norm, self.k_norm = RMSNorm(d_model // n_heads), RMSNorm(d_model // n_heads)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask))
        return self.o_proj(merge(y))


class FreeRMSNorm(nn.Module):
    """An RMSNorm with no parameters (nanochat's): nothing says the width it normalises."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):  # in float32, as nanochat's (an fp16 square overflows at |x| > 256)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class ParamFreeQKNorm(QKNorm):
    """nanochat's per-head norms on q and k, with no parameters: found as norms at d_model, but called per head."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.q_norm, self.k_norm = FreeRMSNorm(), FreeRMSNorm()


class WideHeadNorms(QKNorm):
    """Heads as wide as the stream (x-transformers' dim_head 64 at dim 64; Qwen3 with head_dim = hidden_size): per-head
    norms on q, k and v found at d_model, each a norm of its projection's output, not of the stream."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        w = d_model * n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, w, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(w, d_model, bias=False)
        self.q_norm, self.k_norm, self.v_norm = RMSNorm(d_model), RMSNorm(d_model), RMSNorm(d_model)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.n_heads, C).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask))
        return self.o_proj(merge(y))


# A Llama-style causal block with its attention written out (so positions, biases and masks can be planted): RoPE in
# the rotate_half layout with angles in float32, masks filled with the dtype's finite minimum, a norm that upcasts.


class UpcastRMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the input dtype (as Llama's); offset=1 gives Gemma's (1 + w) with w = 0 at init.
    Called with a residual it adds first and returns (normed, sum): a fused add."""

    def __init__(self, d, eps=1e-6, offset=0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            return self.normed(x), x
        return self.normed(x)

    def normed(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)

