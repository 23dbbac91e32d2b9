"""Small invented models in the styles of nanoGPT, gpt-fast and Meta's llama, for the cache conventions' tests.

Each layer is a correct pre-norm causal block, so decoding token by token through the model's own cache equals its
full causal forward. The litgpt and torchtune styles are in blocks_models_tuned.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from blocks_configs import Block, GPTConfig, RMSNorm


def angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Rotary angles (..., head_dim / 2) for integer positions of any shape."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    return positions.to(torch.float64)[..., None] * inv


def rope(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) rotated by theta (T, D/2) or (B, T, D/2), rotate-half layout."""
    if theta.dim() == 3:
        theta = theta[:, None]  # (B, 1, T, D/2): the same positions for every head
    cos, sin = torch.cat([theta.cos()] * 2, -1).to(x.dtype), torch.cat([theta.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), \
            nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---- nanoGPT style: no cache of its own; its config and block are blocks_configs' ----

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)), ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


# ---- gpt-fast style: setup_caches before any forward, KV buffers written in place at input_pos ----

@dataclass
class ModelArgs:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    dim: int = 32
    intermediate_size: int = 64
    n_local_heads: int = -1  # grouped-query: the kv heads; -1 = n_head
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class FastAttention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.dim // config.n_head
        self.wqkv = nn.Linear(config.dim, (config.n_head + 2 * config.n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, theta, mask, input_pos):
        B, T, C = x.shape
        kv = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([C, kv, kv], dim=-1)
        q = rope(q.view(B, T, self.n_head, self.head_dim).transpose(1, 2), theta)
        k = rope(k.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2), theta)
        v = v.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FastBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention, self.feed_forward = FastAttention(config), SwiGLU(config.dim, config.intermediate_size)
        self.attention_norm, self.ffn_norm = RMSNorm(config.dim, config.norm_eps), RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, input_pos, theta, mask):
        h = x + self.attention(self.attention_norm(x), theta, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(FastBlock(config) for _ in range(config.n_layer))
        self.norm, self.output = RMSNorm(config.dim, config.norm_eps), nn.Linear(config.dim, config.vocab_size, bias=False)
        self.freqs = None
        self.max_batch_size = self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        max_seq_length = 8 * math.ceil(max_seq_length / 8)
        self.max_seq_length, self.max_batch_size = max_seq_length, max_batch_size
        head_dim = self.config.dim // self.config.n_head
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.config.n_local_heads, head_dim,
                                           self.output.weight.dtype)
        self.freqs = angles(torch.arange(self.config.block_size), head_dim)
        self.causal_mask = torch.tril(torch.ones(max_seq_length, max_seq_length, dtype=torch.bool))

    def forward(self, idx, input_pos=None):
        assert self.freqs is not None, "Caches must be initialized first"
        mask = self.causal_mask[None, None, input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, input_pos, self.freqs[input_pos], mask)
        return self.output(self.norm(x))


# ---- Meta llama style: start_pos, caches as plain attributes built with .cuda() in __init__ ----

@dataclass
class LlamaArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 64
    norm_eps: float = 1e-5
    max_batch_size: int = 4
    max_seq_len: int = 32


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        shape = (args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)
        self.cache_k = torch.zeros(shape).cuda()
        self.cache_v = torch.zeros(shape).cuda()

    def forward(self, x, start_pos, theta, mask):
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        xk = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        xq = rope(xq.transpose(1, 2), theta).transpose(1, 2)
        xk = rope(xk.transpose(1, 2), theta).transpose(1, 2)
        self.cache_k, self.cache_v = self.cache_k.to(xq), self.cache_v.to(xq)
        self.cache_k[:B, start_pos : start_pos + T] = xk
        self.cache_v[:B, start_pos : start_pos + T] = xv
        rep = self.n_heads // self.n_kv_heads
        keys = self.cache_k[:B, : start_pos + T].repeat_interleave(rep, dim=2).transpose(1, 2)  # (B, H, S, D)
        values = self.cache_v[:B, : start_pos + T].repeat_interleave(rep, dim=2).transpose(1, 2)
        scores = xq.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (B, H, T, S)
        y = F.softmax(scores, dim=-1) @ values
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LlamaBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention, self.feed_forward = LlamaAttention(args), SwiGLU(args.dim, 2 * args.dim)
        self.attention_norm, self.ffn_norm = RMSNorm(args.dim, args.norm_eps), RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, start_pos, theta, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, theta, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, params: LlamaArgs):
        super().__init__()
        self.params = params
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = nn.ModuleList(LlamaBlock(params) for _ in range(params.n_layers))
        self.norm, self.output = RMSNorm(params.dim, params.norm_eps), nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs = angles(torch.arange(2 * params.max_seq_len), params.dim // params.n_heads)

    @torch.inference_mode()
    def forward(self, tokens, start_pos: int):
        _, T = tokens.shape
        h = self.tok_embeddings(tokens)
        mask = None
        if T > 1:
            mask = torch.triu(torch.full((T, T), float("-inf"), device=tokens.device), diagonal=1)
            mask = torch.hstack([torch.zeros((T, start_pos), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, self.freqs[start_pos : start_pos + T], mask)
        return self.output(self.norm(h))
