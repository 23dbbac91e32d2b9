"""Correct designs of popular libraries (written after x-transformers' options) that earlier versions raised alarms
on: cosine attention (q and k L2-normalised, the scores times a temperature of 10, a `scale` of 1/sqrt(d_head) kept
unused), ScaleNorm (one scalar gain, so no parameter says the width it normalises), a position bias computed by an MLP
over distances (a chain of projections that reads no tensor of the stream's width), learned memory keys and values
concatenated to k and v (parameters of the attention module that are no projection), and talking heads (a learned
map over heads before the softmax, whose score scale cannot be read as one multiple of each head's q.k; or, started as
the identity added to the scores, moves with the map's weights). Each is
`TrainBlock` of tests/zoo_training.py with one thing changed; constructors take tblock's keywords."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge

# F.normalize's default eps, 1e-12, is 0 in float16: a zero token would give 0/0 (the `finite` check's zero input)
EPS = 1e-6


def causal_softmax(s):
    T = s.shape[-1]
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf")).softmax(-1)


class ModuleAttentionBlock(TrainBlock):
    """TrainBlock with its attention replaced by a module of `attention_class`, built at (d_model, n_heads)."""

    attention_class: type

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj
        self.attn = self.attention_class(d_model, n_heads)

    def attention(self, h):
        return self.attn(h)


class CosineAttention(nn.Module):
    """q and k L2-normalised per head, their product times a fixed temperature (x-transformers' attn_qk_norm with
    qk_norm_scale 10, Swin v2): `scale` holds 1/sqrt(d_head), as the module keeps it for its other mode, unused."""

    def __init__(self, d_model, n_heads, temperature=10.0):
        super().__init__()
        self.n_heads, self.temperature = n_heads, temperature
        self.scale = (d_model // n_heads) ** -0.5
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        q, k = F.normalize(q, dim=-1, eps=EPS), F.normalize(k, dim=-1, eps=EPS)
        return self.to_out(merge(causal_softmax((q @ k.transpose(-2, -1)) * self.temperature) @ v))


class CosineAttentionBlock(ModuleAttentionBlock):
    attention_class = CosineAttention


class ScaleNorm(nn.Module):
    """x / |x| * sqrt(d) * (1 + g), g one scalar initialised to 0 (x-transformers' ScaleNorm with a unit offset)."""

    def __init__(self, d_model):
        super().__init__()
        self.scale = d_model**0.5
        self.g = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=EPS) * self.scale * (self.g + 1)


class ScaleNormBlock(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = ScaleNorm(d_model), ScaleNorm(d_model)


class DistanceBiasBlock(TrainBlock):
    """A bias per head computed by an MLP over the distance j - i (x-transformers' dynamic position bias), added to
    causal scores: Linear(1, d/4) -> SiLU -> Linear(d/4, d/4) -> SiLU -> Linear(d/4, heads) over log distances."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        w = d_model // 4
        self.bias_mlp = nn.Sequential(nn.Linear(1, w), nn.SiLU(), nn.Linear(w, w), nn.SiLU(), nn.Linear(w, n_heads))

    def attention(self, h):
        T = h.shape[1]
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        pos = torch.arange(T, device=h.device)  # integers: exact at any length, whatever the block's dtype
        rel = (pos[None, :] - pos[:, None]).float()
        rel = (rel.sign() * rel.abs().log1p()).to(h.dtype)  # log distances (x-transformers' log_distance): bounded
        bias = self.bias_mlp(rel[..., None]).permute(2, 0, 1)  # (heads, T, T)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + bias
        return self.o_proj(merge(causal_softmax(s) @ v))


class MemoryAttention(nn.Module):
    """Learned memory keys and values (x-transformers' attn_num_mem_kv), concatenated before the sequence's: every
    query may attend to them, causality kept among the tokens."""

    def __init__(self, d_model, n_heads, memories=4):
        super().__init__()
        self.n_heads = n_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.mem_k = nn.Parameter(torch.randn(n_heads, memories, d_model // n_heads))
        self.mem_v = nn.Parameter(torch.randn(n_heads, memories, d_model // n_heads))

    def forward(self, h):
        B, T, _ = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        M = self.mem_k.shape[1]
        k = torch.cat((self.mem_k.expand(B, -1, -1, -1), k), dim=2)
        v = torch.cat((self.mem_v.expand(B, -1, -1, -1), v), dim=2)
        allowed = torch.cat((torch.ones(T, M, dtype=torch.bool, device=h.device),
                             torch.ones(T, T, dtype=torch.bool, device=h.device).tril()), dim=1)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return self.to_out(merge(s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v))


class MemoryKVBlock(ModuleAttentionBlock):
    attention_class = MemoryAttention


class TalkingHeadsAttention(nn.Module):
    """Talking heads (Shazeer et al. 2020): a learned heads x heads map over the scores before the softmax, randomly
    initialised; `scale` 1/sqrt(d_head) applied before it."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.scale = n_heads, (d_model // n_heads) ** -0.5
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.mix = nn.Parameter(torch.eye(n_heads) + 0.5 * torch.randn(n_heads, n_heads) / math.sqrt(n_heads))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = torch.einsum("gh,bhij->bgij", self.mix, (q @ k.transpose(-2, -1)) * self.scale)
        return self.to_out(merge(causal_softmax(s) @ v))


class TalkingHeadsBlock(ModuleAttentionBlock):
    attention_class = TalkingHeadsAttention


class AddedTalkingHeads(TalkingHeadsAttention):
    """x-transformers' talking heads: the map added to the scores (`sim + conv(sim)`) and initialised as the identity,
    so the logits start at twice the `scale` the module keeps, with no mixing between heads until it trains."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.mix = nn.Parameter(torch.eye(n_heads))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = (q @ k.transpose(-2, -1)) * self.scale
        s = s + torch.einsum("gh,bhij->bgij", self.mix, s)
        return self.to_out(merge(causal_softmax(s) @ v))


class AddedTalkingHeadsBlock(ModuleAttentionBlock):
    attention_class = AddedTalkingHeads


CORRECT = ["CosineAttentionBlock", "ScaleNormBlock", "DistanceBiasBlock", "MemoryKVBlock", "TalkingHeadsBlock",
           "AddedTalkingHeadsBlock"]
