"""Blocks whose outputs depend on the sequence's length where they should not, for the `causal` check's prefix probe
and the `shape` check's one-token probe: a score scaled by the key count (`k.size(-2)` where `k.size(-1)` was meant),
learned positions aligned to the end of the table, a gate squeezed of its length on one token; and the correct
twins: ALiBi counted from the last key (a constant per row, which the softmax ignores), a sequence padded to whole
chunks and cut back. Each is `TrainBlock` of tests/zoo_training.py with one method changed."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, attend

# ----------------------------------------------------------------------------- planted


class ScaleByKeyCount(TrainBlock):
    """Scores scaled by 1/sqrt(k.size(-2)), the number of keys, where k.size(-1), the head's width, was meant."""

    def attention(self, h):
        k_count = h.shape[1]
        return attend(self, h, scale=1 / math.sqrt(k_count))


class EndAlignedPositions(TrainBlock):
    """Learned absolute positions taken from the end of the table (pos[-T:]) instead of its start."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.pos = nn.Parameter(torch.randn(64, d_model) * 0.5)

    def forward(self, x):
        return super().forward(x + self.pos[-x.shape[1]:])


class SqueezedGate(TrainBlock):
    """A per-token gate (B, T, 1) squeezed with squeeze(), which on one token drops the length too."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gate = nn.Linear(d_model, 1)

    def ffn(self, h):
        g = torch.sigmoid(self.gate(h)).squeeze()
        return super().ffn(h) * g.unsqueeze(-1)


# ----------------------------------------------------------------------------- correct twins


class AlibiFromLastKey(TrainBlock):
    """ALiBi as some ports write it: each key's bias from its own index, -(T - 1 - j) * slope, the same along a row,
    so the softmax takes away the row's constant and a prefix computes what the whole sequence computes."""

    def attention(self, h):
        T = h.shape[1]
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.n_heads + 1, device=h.device) / self.n_heads)
        j = torch.arange(T, device=h.device, dtype=h.dtype)
        return attend(self, h, bias=-(T - 1 - j)[None, None, :] * slopes[:, None, None])


class PaddedToChunks(TrainBlock):
    """Causal attention run on the sequence padded with zeros to a multiple of 8 and cut back: padding after the
    last token changes nothing before it."""

    def attention(self, h):
        T = h.shape[1]
        padded = F.pad(h, (0, 0, 0, -T % 8))
        return attend(self, padded)[:, :T]


PLANTED = {"ScaleByKeyCount": ("causal", "causal.prefix"), "EndAlignedPositions": ("causal", "causal.prefix"),
           "SqueezedGate": ("shape", "shape.one_token")}
CORRECT = ["AlibiFromLastKey", "PaddedToChunks"]
