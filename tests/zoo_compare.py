"""Blocks for `tblock compare`: a Llama layer written from scratch with Hugging Face's parameter names, three
planted porting bugs in it, and one function written with a fused and with separate q/k/v projections.

`ScratchLlama` must equal `hf:llama` with the weights carried across by name; each bug changes one thing.
The constructors take tblock's keywords (d_model, n_heads, d_ff) so `compare tests/zoo_compare.py:NAME` builds them.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, theta):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(n_heads * self.hd, d_model, bias=False)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd), persistent=False)

    def rope(self, q, k):
        T = q.shape[-2]
        freqs = torch.arange(T, device=q.device).float()[:, None] * self.inv_freq[None]  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def expand_kv(self, t):
        return t.repeat_interleave(self.n_heads // self.n_kv, dim=1)  # kv head j serves query heads j*g .. j*g+g-1

    def forward(self, h, pad_mask=None):
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.rope(q, k)
        k, v = self.expand_kv(k), self.expand_kv(v)
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[None, None]
        if pad_mask is not None:
            allowed = allowed & ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ScratchLlama(nn.Module):
    """A Llama decoder layer as HF's LlamaDecoderLayer computes it (rotate-half RoPE, GQA, SwiGLU), HF's names."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, eps=1e-6, theta=10000.0):
        super().__init__()
        self.causal = True
        self.self_attn = Attention(d_model, n_heads, n_kv_heads or n_heads, theta)
        self.mlp = MLP(d_model, d_ff or 4 * d_model)
        self.input_layernorm = RMSNorm(d_model, eps)
        self.post_attention_layernorm = RMSNorm(d_model, eps)

    def forward(self, x, pad_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), pad_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- planted porting bugs


class BiasedLlama(ScratchLlama):
    """Biases on q/k/v/o (nn.Linear's default) where Llama has none: the same function once they are zeroed, other
    parameters to train, and a Llama checkpoint leaves them at their random init."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, eps=1e-6, theta=10000.0):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, eps, theta)
        a = self.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            old = getattr(a, name)
            setattr(a, name, nn.Linear(old.in_features, old.out_features))


class StdEpsNorm(RMSNorm):
    def forward(self, x):
        h = x.float()
        return self.weight * (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(x.dtype)  # bug: eps outside


class EpsOutsideLlama(ScratchLlama):
    """RMSNorm dividing by rms + eps where Llama divides by sqrt(ms + eps): the same eps, another floor."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, eps=1e-6, theta=10000.0):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, eps, theta)
        self.input_layernorm, self.post_attention_layernorm = StdEpsNorm(d_model, eps), StdEpsNorm(d_model, eps)


class TiledAttention(Attention):
    def expand_kv(self, t):
        return t.repeat(1, self.n_heads // self.n_kv, 1, 1)  # bug: query head i reads kv head i % n_kv


class TiledEagerAttention(TiledAttention):
    def forward(self, h, pad_mask=None):  # attention written out: q.k^T, mask, softmax, times v
        B, T, _ = h.shape
        q = self.q_proj(h).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.rope(q, k)
        k, v = self.expand_kv(k), self.expand_kv(v)
        scores = torch.matmul(q, k.transpose(2, 3)) / self.hd ** 0.5  # (B, nh, T, T)
        blocked = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)[None, None]
        if pad_mask is not None:
            blocked = blocked | pad_mask[:, None, None, :]
        w = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(B, T, -1))


class SwappedMLP(MLP):
    def forward(self, x):
        return self.down_proj(F.silu(self.up_proj(x)) * self.gate_proj(x))  # bug: the activation on up, not gate


class ActAfterProductMLP(MLP):
    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x) * self.up_proj(x)))  # bug: silu of the product


class InterleavedRopeAttention(Attention):
    def rope(self, q, k):  # Meta's layout: rotates pairs (2i, 2i+1) where HF's rotates (i, i + hd/2)
        T = q.shape[-2]
        freqs = torch.arange(T, device=q.device).float()[:, None] * self.inv_freq[None]
        cos, sin = freqs.cos().repeat_interleave(2, -1).to(q.dtype), freqs.sin().repeat_interleave(2, -1).to(q.dtype)

        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class LlamaGQATiled(ScratchLlama):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, **kw)
        self.self_attn = TiledAttention(d_model, n_heads, n_kv_heads or n_heads, 10000.0)


class LlamaGQATiledEager(ScratchLlama):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, **kw)
        self.self_attn = TiledEagerAttention(d_model, n_heads, n_kv_heads or n_heads, 10000.0)


class LlamaGateUpSwapped(ScratchLlama):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, **kw)
        self.mlp = SwappedMLP(d_model, d_ff or 4 * d_model)


class LlamaActAfterProduct(ScratchLlama):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, **kw)
        self.mlp = ActAfterProductMLP(d_model, d_ff or 4 * d_model)


class LlamaInterleavedRope(ScratchLlama):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, n_kv_heads=None, **kw):
        super().__init__(d_model, n_heads, d_ff, n_kv_heads, **kw)
        self.self_attn = InterleavedRopeAttention(d_model, n_heads, n_kv_heads or n_heads, 10000.0)


# ----------------------------------------------------------------------------- one function, two layouts


class SeparateQKV(nn.Module):
    """Pre-LN block, SDPA attention, q/k/v as three projections."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, d_ff or 4 * d_model)
        self.fc_out = nn.Linear(d_ff or 4 * d_model, d_model)

    def qkv(self, h):
        return self.query(h), self.key(h), self.value(h)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)))
        mask = None if pad_mask is None else ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class FusedQKV(SeparateQKV):
    """The same function with one (3d, d) projection, as GPT-2 and nanoGPT write it."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None):
        super().__init__(d_model, n_heads, d_ff)
        del self.query, self.key, self.value
        self.c_attn = nn.Linear(d_model, 3 * d_model)

    def qkv(self, h):
        return self.c_attn(h).split(h.shape[-1], dim=-1)


class BertNoKeyBias(nn.Module):
    """A BERT layer (Post-LN, GELU, eps 1e-12) whose key projection has no bias (as Whisper and BEiT build theirs): a
    key bias moves every score of a query's row by the same amount, which softmax ignores, so BERT's checkpoints
    compute the same here with theirs dropped. Correct against hf:bert."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, eps=1e-12):
        super().__init__()
        self.nh, d_ff = n_heads, d_ff or 4 * d_model
        self.query, self.value = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model, bias=False)
        self.attn_dense, self.attn_ln = nn.Linear(d_model, d_model), nn.LayerNorm(d_model, eps=eps)
        self.intermediate, self.out_dense = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.out_ln = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = (m(x).view(B, T, self.nh, -1).transpose(1, 2) for m in (self.query, self.key, self.value))
        mask = None if pad_mask is None else ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_ln(x + self.attn_dense(y.transpose(1, 2).reshape(B, T, C)))
        return self.out_ln(x + self.out_dense(F.gelu(self.intermediate(x))))
