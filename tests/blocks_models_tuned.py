"""Small invented models in the styles of litgpt and torchtune, for the cache conventions' tests.

Each layer is a correct pre-norm causal block with grouped-query attention, so decoding token by token through the
model's own cache equals its full causal forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from blocks_models import RMSNorm, SwiGLU, angles, rope


def grouped_attention(q, k, v, mask):
    """q (B, H, T, D), k and v (B, G, S, D) with G dividing H; mask (B or 1, 1, T, S) bool, True = attend, or None
    for plain causal."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


# ---- litgpt style: set_kv_cache / clear_kv_cache, forward(idx, input_pos=None, input_pos_maxp1=None) ----

@dataclass
class Config:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_query_groups: int = 2
    n_embd: int = 32
    intermediate_size: int = 64


class LitKVCache(nn.Module):
    def __init__(self, shape, device=None, dtype=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def forward(self, input_pos, k, v):
        bs = k.shape[0]
        return self.k[:bs].index_copy_(2, input_pos, k), self.v[:bs].index_copy_(2, input_pos, v)


class LitAttention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config, self.head_size = config, config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * self.head_size, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.kv_cache: LitKVCache | None = None

    def forward(self, x, theta, mask, input_pos, input_pos_maxp1):
        B, T, C = x.shape
        H, G, D = self.config.n_head, self.config.n_query_groups, self.head_size
        q, k, v = self.qkv(x).split([H * D, G * D, G * D], dim=-1)
        q = rope(q.view(B, T, H, D).transpose(1, 2), theta)
        k = rope(k.view(B, T, G, D).transpose(1, 2), theta)
        v = v.view(B, T, G, D).transpose(1, 2)
        if input_pos is not None:
            k, v = self.kv_cache(input_pos, k, v)
            if input_pos_maxp1 is not None:
                k, v = k[..., :input_pos_maxp1, :], v[..., :input_pos_maxp1, :]
        return self.proj(grouped_attention(q, k, v, mask).transpose(1, 2).reshape(B, T, C))


class LitBlock(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.norm_1, self.attn = RMSNorm(config.n_embd), LitAttention(config)
        self.norm_2, self.mlp = RMSNorm(config.n_embd), SwiGLU(config.n_embd, config.intermediate_size)

    def forward(self, x, theta, mask, input_pos=None, input_pos_maxp1=None):
        x = x + self.attn(self.norm_1(x), theta, mask, input_pos, input_pos_maxp1)
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(config.vocab_size, config.n_embd),
                                              h=nn.ModuleList(LitBlock(config) for _ in range(config.n_layer)),
                                              ln_f=RMSNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.max_seq_length = config.block_size
        self.register_buffer("theta", angles(torch.arange(config.block_size), config.n_embd // config.n_head),
                             persistent=False)
        self.mask_cache = None

    def set_kv_cache(self, batch_size, max_seq_length=None, device=None, dtype=None):
        max_seq_length = max_seq_length or self.max_seq_length
        shape = (batch_size, self.config.n_query_groups, max_seq_length, self.config.n_embd // self.config.n_head)
        for block in self.transformer.h:
            block.attn.kv_cache = LitKVCache(shape, device, dtype)
        self.mask_cache = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool, device=device))

    def clear_kv_cache(self):
        self.mask_cache = None
        for block in self.transformer.h:
            block.attn.kv_cache = None

    def forward(self, idx, input_pos=None, input_pos_maxp1=None):
        T = idx.shape[1]
        if input_pos is not None:
            theta, mask = self.theta[input_pos], self.mask_cache[None, None, input_pos]  # (1, 1, T, S)
            if input_pos_maxp1 is not None:
                mask = mask[..., :input_pos_maxp1]
        else:
            theta, mask, input_pos_maxp1 = self.theta[:T], None, None
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, theta, mask, input_pos, input_pos_maxp1)
        return self.lm_head(self.transformer.ln_f(x))


# ---- torchtune style: a builder; setup_caches(batch_size, dtype, ...); mask and input_pos with caches on ----

class TuneKVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim, dtype):
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, max_seq_len), persistent=False)

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.cache_pos[0].item()

    def update(self, k_val, v_val):
        T = k_val.shape[2]
        self.k_cache[:, :, self.cache_pos[:T]] = k_val  # written at its own pointer, not at input_pos
        self.v_cache[:, :, self.cache_pos[:T]] = v_val
        self.cache_pos.add_(T)
        return self.k_cache, self.v_cache


class TuneAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.kv_cache, self.cache_enabled = None, False

    def setup_cache(self, batch_size, dtype, max_seq_len):
        if self.kv_cache is None:
            self.kv_cache = TuneKVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim, dtype)
            self.cache_enabled = True

    def forward(self, x, mask=None, input_pos=None):
        B, T, C = x.shape
        theta = angles(torch.arange(T, device=x.device) if input_pos is None else input_pos, self.head_dim)
        q = rope(self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2), theta)
        k = rope(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2), theta)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None and self.cache_enabled:
            k, v = self.kv_cache.update(k, v)
        y = grouped_attention(q, k, v, None if mask is None else mask[:, None])
        return self.output_proj(y.transpose(1, 2).reshape(B, T, C))


class TuneLayer(nn.Module):
    def __init__(self, attn: TuneAttention, mlp: nn.Module, sa_norm: nn.Module, mlp_norm: nn.Module):
        super().__init__()
        self.attn, self.mlp, self.sa_norm, self.mlp_norm = attn, mlp, sa_norm, mlp_norm

    def forward(self, x, *, mask=None, input_pos=None):
        h = x + self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.mlp_norm(h))


class TuneDecoder(nn.Module):
    def __init__(self, tok_embeddings, layers, norm, output, max_seq_len):
        super().__init__()
        self.tok_embeddings, self.layers, self.norm, self.output = tok_embeddings, layers, norm, output
        self.max_seq_len, self.decoder_max_cache_seq_len = max_seq_len, None

    def setup_caches(self, batch_size, dtype, *, encoder_max_seq_len=None, decoder_max_seq_len=None):
        self.decoder_max_cache_seq_len = decoder_max_seq_len or self.max_seq_len
        for layer in self.layers:
            layer.attn.setup_cache(batch_size, dtype, self.decoder_max_cache_seq_len)

    def caches_are_enabled(self):
        return self.layers[0].attn.cache_enabled

    def reset_caches(self):
        for layer in self.layers:
            layer.attn.kv_cache.reset()

    def forward(self, tokens, *, mask=None, input_pos=None):
        if self.caches_are_enabled() and (mask is None or input_pos is None):
            raise ValueError("KV-caches are set up: mask and input_pos must be provided")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos)
        return self.output(self.norm(h))


def tiny_decoder(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32):
    """A decoder built as torchtune's builders build theirs: ready-made parts handed to the layer."""
    layers = nn.ModuleList(
        TuneLayer(TuneAttention(embed_dim, num_heads, num_kv_heads), SwiGLU(embed_dim, 2 * embed_dim),
                  RMSNorm(embed_dim), RMSNorm(embed_dim)) for _ in range(num_layers))
    return TuneDecoder(nn.Embedding(vocab_size, embed_dim), layers, RMSNorm(embed_dim),
                       nn.Linear(embed_dim, vocab_size, bias=False), max_seq_len)


class ScaledMix(nn.Module):
    """A layer behind LayerScale 1e-6 (ConvNeXt's and deep CaiT's init) mixing each position with its neighbours:
    a centred convolution (both sides) or a causal one (earlier positions only)."""

    def __init__(self, d, causal):
        super().__init__()
        self.causal = causal
        self.conv = nn.Conv1d(d, d, 3, padding=2 if causal else 1, groups=d)
        self.gamma = nn.Parameter(torch.full((d,), 1e-6))

    def forward(self, x):
        h = self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return x + self.gamma * h


class ScaledModel(nn.Module):
    def __init__(self, n_embd: int = 32, causal: bool = False):
        super().__init__()
        self.emb = nn.Embedding(8, n_embd)
        self.layers = nn.ModuleList([ScaledMix(n_embd, causal)])

    def forward(self, idx):
        return self.layers[0](self.emb(idx))

