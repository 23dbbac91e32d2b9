"""Blocks whose parts torch runs its own way. A compiled part: the FFN a `torch.compile`d submodule (the eager backend:
no C++ build), and its eager twin; tblock probes what the block computes, so the compiled part runs eagerly inside
its checks, card and FLOP trace, where dynamo would refuse the modes and hooks they wrap the forward in. A kernel with
no backward on this device: FlexAttention, whose CPU and MPS forwards refuse to record autograd."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden, dropout):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        return self.drop(self.w2(F.silu(self.w1(h)) * self.w3(h)))


class EagerFFN(TrainBlock):
    """TrainBlock with its FFN as a submodule."""

    compiled = False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        mlp = SwiGLU(d_model, int(8 * d_model / 3), dropout)
        self.mlp = torch.compile(mlp, backend="eager") if self.compiled else mlp

    def ffn(self, h):
        return self.mlp(h)


class CompiledFFN(EagerFFN):
    """Correct: the same FFN compiled."""

    compiled = True


class FlexBlock(TrainBlock):
    """Correct: attention through FlexAttention with a causal block mask (torchtune's and gpt-fast's way)."""

    def attention(self, h):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        T = h.shape[1]
        mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, None, None, T, T, device=h.device) if self.causal else None
        return self.o_proj(merge(flex_attention(q, k, v, block_mask=mask)))
