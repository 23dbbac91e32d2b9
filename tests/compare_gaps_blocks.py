"""Blocks for three things `tblock compare` must say: a weighted q/k-norm against a weight-free one, a fused q/k/v
projection split in another order, and a difference on the cached (decode) path only.

The constructors take tblock's keywords (d_model, n_heads, d_ff)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class QKNormBlock(nn.Module):
    """Pre-LN, causal SDPA, an RMS norm on each head's queries and keys: weight-free, or with a weight (ones, as HF
    initialises it; random where `trained`)."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, weighted=False, trained=False):
        super().__init__()
        self.h, self.hd = n_heads, d_model // n_heads
        self.causal = True
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.o_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.q_norm = nn.RMSNorm(self.hd, eps=1e-6, elementwise_affine=weighted)
        self.k_norm = nn.RMSNorm(self.hd, eps=1e-6, elementwise_affine=weighted)
        if weighted and trained:
            with torch.no_grad():
                self.q_norm.weight.uniform_(0.5, 1.5)
                self.k_norm.weight.uniform_(0.5, 1.5)
        self.fc_in, self.fc_out = nn.Linear(d_model, d_ff or 4 * d_model), nn.Linear(d_ff or 4 * d_model, d_model)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(B, T, self.h, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class SeparateQKV(nn.Module):
    """Pre-LN block, SDPA attention, q/k/v as three projections."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.fc_in, self.fc_out = nn.Linear(d_model, d_ff or 4 * d_model), nn.Linear(d_ff or 4 * d_model, d_model)

    def qkv(self, h):
        return self.query(h), self.key(h), self.value(h)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x))))


class FusedQKV(SeparateQKV):
    """The same function with one (3d, d) projection whose rows are read in `order` (qkv as GPT-2; kqv a port that
    took another checkpoint's layout)."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, order="qkv"):
        super().__init__(d_model, n_heads, d_ff)
        del self.query, self.key, self.value
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.order = order

    def qkv(self, h):
        parts = dict(zip(self.order, self.c_attn(h).split(h.shape[-1], dim=-1)))
        return parts["q"], parts["k"], parts["v"]


def rope(t, pos, theta=10000.0):
    """Rotate-half rotary of (B, H, T, hd) at the given positions."""
    hd = t.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=t.device, dtype=torch.float64) / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos().to(t.dtype), torch.cat((ang, ang), -1).sin().to(t.dtype)
    t1, t2 = t.chunk(2, -1)
    return t * cos + torch.cat((-t2, t1), -1) * sin


class CachedRope(nn.Module):
    """A causal rotary block with tblock's decode protocol, decode(x_t, cache) -> (y_t, cache). `decode_offset_bug`:
    the cached path rotates each new chunk from position 0 instead of from where the cache ends (the full forward
    is unchanged)."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, decode_offset_bug=False):
        super().__init__()
        self.h, self.hd = n_heads, d_model // n_heads
        self.causal = True
        self.bug = decode_offset_bug
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q_proj, self.k_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.v_proj, self.o_proj = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.fc_in, self.fc_out = nn.Linear(d_model, d_ff or 4 * d_model), nn.Linear(d_ff or 4 * d_model, d_model)

    def attend(self, h, cache, start):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.h, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(T, device=h.device) + (0 if self.bug and start else start)
        q, k = rope(q, pos), rope(k, pos)
        if cache is not None:
            k, v = torch.cat((cache[0], k), 2), torch.cat((cache[1], v), 2)
        S = k.shape[2]
        allowed = torch.arange(S, device=h.device)[None, :] <= (torch.arange(T, device=h.device) + start)[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)

    def block(self, x, cache, start):
        a, cache = self.attend(self.ln_1(x), cache, start)
        x = x + a
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x)))), cache

    def forward(self, x, pad_mask=None):
        return self.block(x, None, 0)[0]

    def decode(self, x, cache=None):
        start = 0 if cache is None else cache[0].shape[2]
        y, kv = self.block(x, cache, start)
        return y, kv


class ScratchQwen3(nn.Module):
    """A Qwen3 decoder layer written from scratch with Hugging Face's names, its per-head q/k RMS norms weight-free
    (F.rms_norm with no weight): what hf:qwen3 computes while its q/k-norm weights are at their init (ones).
    `whole`: the norm taken over the whole projection instead of per head."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, n_kv_heads=None, eps=1e-6, theta=10000.0, whole=False):
        super().__init__()
        import zoo_compare

        self.causal = True
        self.eps = eps
        self.self_attn = zoo_compare.Attention(d_model, n_heads, n_kv_heads or n_heads, theta)
        self.mlp = zoo_compare.MLP(d_model, d_ff or 4 * d_model)
        self.input_layernorm = zoo_compare.RMSNorm(d_model, eps)
        self.post_attention_layernorm = zoo_compare.RMSNorm(d_model, eps)
        attn = self.self_attn

        def normed(proj):
            def forward(h):
                y = F.linear(h, proj.weight)
                if whole:  # a port's bug: one norm over the whole projection, not per head
                    return F.rms_norm(y, (y.shape[-1],), eps=eps)
                return F.rms_norm(y.unflatten(-1, (-1, attn.hd)), (attn.hd,), eps=eps).flatten(-2)
            return forward
        attn.q_proj.forward = normed(attn.q_proj)
        attn.k_proj.forward = normed(attn.k_proj)

    def forward(self, x, pad_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), pad_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _scratch_llama():
    import zoo_compare

    return zoo_compare.ScratchLlama


class DecodingLlama(nn.Module):
    """zoo_compare's ScratchLlama (hf:llama with Hugging Face's names) with tblock's decode protocol, the cache
    (k, v) after rotary; `decode_offset_bug`: each decoded chunk rotated from position 0."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, n_kv_heads=None, decode_offset_bug=False):
        super().__init__()
        layer = _scratch_llama()(d_model, n_heads, d_ff, n_kv_heads)
        self.causal = True
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.bug = decode_offset_bug

    def forward(self, x, pad_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), pad_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x, cache=None):
        a = self.self_attn
        h = self.input_layernorm(x)
        B, T, _ = h.shape
        q = a.q_proj(h).view(B, T, a.n_heads, a.hd).transpose(1, 2)
        k = a.k_proj(h).view(B, T, a.n_kv, a.hd).transpose(1, 2)
        v = a.v_proj(h).view(B, T, a.n_kv, a.hd).transpose(1, 2)
        start = 0 if cache is None else cache[0].shape[2]
        pos = torch.arange(T, device=h.device) + (0 if self.bug else start)
        q, k = rope(q, pos), rope(k, pos)
        if cache is not None:
            k, v = torch.cat((cache[0], k), 2), torch.cat((cache[1], v), 2)
        S = k.shape[2]
        allowed = torch.arange(S, device=h.device)[None, :] <= (torch.arange(T, device=h.device) + start)[:, None]
        y = F.scaled_dot_product_attention(q, a.expand_kv(k), a.expand_kv(v), attn_mask=allowed)
        x = x + a.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.post_attention_layernorm(x)), (k, v)


class ScratchGPT2(nn.Module):
    """A GPT-2 block written from scratch (nn.Linear where GPT-2 has Conv1D), its fused c_attn rows read in `order`
    (qkv as GPT-2)."""

    def __init__(self, d_model=32, n_heads=4, d_ff=None, order="qkv"):
        super().__init__()
        self.h, self.order, self.causal = n_heads, order, True
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model, eps=1e-5), nn.LayerNorm(d_model, eps=1e-5)
        self.c_attn, self.c_proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.c_fc, self.mlp_proj = nn.Linear(d_model, d_ff or 4 * d_model), nn.Linear(d_ff or 4 * d_model, d_model)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        parts = dict(zip(self.order, self.c_attn(self.ln_1(x)).split(C, dim=-1)))
        q, k, v = (parts[r].view(B, T, self.h, -1).transpose(1, 2) for r in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
