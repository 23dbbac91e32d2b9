"""Blocks whose constructor takes a config object, in the styles of nanoGPT (a GPTConfig dataclass), gpt-fast (a
ModelArgs dataclass with from_name and a __post_init__), minGPT (a CfgNode attribute bag) and Meta's llama (a layer
index beside the config, a KV cache placed with .cuda()): written for these tests, each a correct Pre-LN block."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int  # required, no default: the longest sequence the causal mask covers
    vocab_size: int  # required, no default: never used by a block
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """nanoGPT's style: `Block(config)`, the config unannotated, its class the module's one dataclass."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = None
    n_local_heads: int = -1
    head_dim: int = 64
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = find_multiple(int(2 * 4 * self.dim / 3), 256)
        self.head_dim = self.dim // self.n_head

    @classmethod
    def from_name(cls, name: str):
        return cls(**PRESETS[name])


PRESETS = {"tiny": dict(n_layer=2, n_head=4, dim=64, n_local_heads=2, intermediate_size=128)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):  # gpt-fast's: normalised in float32, cast back (a float16 square overflows above |x| ~ 256)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class TransformerBlock(nn.Module):
    """gpt-fast's style: `TransformerBlock(config: ModelArgs)`, grouped-query heads (n_local_heads), a SwiGLU FFN."""

    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = config.n_head, config.n_local_heads, config.head_dim
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        cache = (1, config.n_local_heads, config.block_size, config.head_dim)  # gpt-fast's KVCache layout
        self.k_cache, self.v_cache = torch.zeros(cache), torch.zeros(cache)

    def forward(self, x):
        B, T, C = x.shape
        kv = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(self.attention_norm(x)).split([C, kv, kv], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (t.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2) for t in (k, v))
        k, v = self.grouped(k), self.grouped(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.wo(y.transpose(1, 2).contiguous().view(B, T, C))
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


    def grouped(self, t):
        """(B, kv heads, T, hd) -> (B, heads, T, hd): each key/value head read by n_head // n_local_heads query heads."""
        return t.repeat_interleave(self.n_head // self.n_local_heads, dim=1)


class CfgNode:
    """minGPT's style: a bag of attributes built from any keywords."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class BagBlock(nn.Module):
    """minGPT's style: `BagBlock(config)`, the config a CfgNode whose fields are whatever the code reads."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, dropout=config.attn_pdrop, batch_first=True)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.resid_pdrop)
        self.register_buffer("bias", torch.ones(config.block_size, config.block_size).tril().bool())

    def forward(self, x):
        T = x.shape[1]
        h = self.ln_1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=~self.bias[:T, :T], need_weights=False)[0])
        return x + self.drop(self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))



@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1
    multiple_of: int = 256
    norm_eps: float = 1e-5
    max_batch_size: int = 32
    max_seq_len: int = 2048


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, n_kv, hd) -> (B, T, n_kv * n_rep, hd), each kv head repeated n_rep times (expand, then reshape)."""
    B, T, n_kv, hd = x.shape
    return x if n_rep == 1 else x[:, :, :, None, :].expand(B, T, n_kv, n_rep, hd).reshape(B, T, n_kv * n_rep, hd)


class LlamaLayer(nn.Module):
    """Meta's llama style: `LlamaLayer(layer_id, args: LlamaArgs)`, the KV cache allocated with `.cuda()` in the
    constructor (a plain attribute of (max_batch, max_seq, n_kv_heads, head_dim)), attention written out."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        hidden = args.multiple_of * ((int(2 * 4 * args.dim / 3) + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        shape = (args.max_batch_size, args.max_seq_len, self.n_kv_heads, self.head_dim)
        self.cache_k = torch.zeros(shape).cuda()
        self.cache_v = torch.zeros(shape).cuda()

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attention_norm(x)
        xq = self.wq(h).view(B, T, self.n_heads, self.head_dim)
        xk = self.wk(h).view(B, T, self.n_kv_heads, self.head_dim)
        xv = self.wv(h).view(B, T, self.n_kv_heads, self.head_dim)
        keys = repeat_kv(xk, self.n_heads // self.n_kv_heads).transpose(1, 2)  # (B, nh, T, hd)
        values = repeat_kv(xv, self.n_heads // self.n_kv_heads).transpose(1, 2)
        scores = xq.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + torch.full((T, T), float("-inf"), device=x.device).triu(1)
        y = (F.softmax(scores.float(), dim=-1).type_as(xq) @ values).transpose(1, 2).reshape(B, T, -1)
        h = x + self.wo(y)
        n = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))
