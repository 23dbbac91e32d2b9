"""A block with a compiled part: its FFN a `torch.compile`d submodule (the eager backend: no C++ build), and its
eager twin. tblock probes what the block computes, so the compiled part runs eagerly inside its checks, card and
FLOP trace, where dynamo would refuse the modes and hooks they wrap the forward in."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock


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
