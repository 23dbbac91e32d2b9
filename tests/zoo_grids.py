"""Vision blocks whose positions are 2D: a class token then a 3 x 3 patch grid laid out row by row, 10 tokens and
no other length (a table sized for the grid). Their identical-token scores are a function of the (row, column) offset,
not of i - j: `relative` reads the grid, `shape` and `position_bias` leave the fixed length alone. The correct ones:
BEiT's relative bias table and EVA-02's 2D rotary (half of each head's pairs turn with the row, half with the
column). Planted: the 2D rotary with q turned by the row and k by the column."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge

GRID, PREFIX = 3, 1
TOKENS = PREFIX + GRID * GRID


class GridBiasBlock(TrainBlock):
    """BEiT: a learned bias per head for each (row, column) offset between patches, the class token's own entries."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal=False)
        span = 2 * GRID - 1
        self.table = nn.Parameter(torch.randn(span * span + 3, n_heads) * 0.5)
        i = torch.arange(GRID * GRID)
        rel = (i[:, None] // GRID - i[None, :] // GRID + GRID - 1) * span + (i[:, None] % GRID - i[None, :] % GRID + GRID - 1)
        index = torch.zeros(TOKENS, TOKENS, dtype=torch.long)
        index[PREFIX:, PREFIX:] = rel
        index[0, :], index[:, 0], index[0, 0] = span * span, span * span + 1, span * span + 2
        self.register_buffer("index", index, persistent=False)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        bias = self.table[self.index].permute(2, 0, 1)  # (heads, T, T): only the grid's length exists
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


def turned(t, pos, base=100.0):
    """t's channel pairs (i, i + n/2) turned by pos * base^(-2i/n): pos per token, t (B, H, N, n)."""
    n = t.shape[-1]
    freqs = base ** (-torch.arange(0, n, 2, device=t.device, dtype=torch.float32) / n)
    ang = pos.to(torch.float32)[:, None] * freqs
    cos, sin = ang.cos().to(t.dtype), ang.sin().to(t.dtype)
    a, b = t[..., : n // 2], t[..., n // 2:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class GridRotaryBlock(TrainBlock):
    """EVA-02: the class token unturned; each patch's first half of channels turned by its row, the second by its
    column."""

    q_axes, k_axes = ("row", "col"), ("row", "col")

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal=False)

    def rotate(self, t, axes):
        patches, half = t[:, :, PREFIX:], t.shape[-1] // 2
        i = torch.arange(patches.shape[-2], device=t.device)
        pos = {"row": i // GRID, "col": i % GRID}
        if patches.shape[-2] != GRID * GRID:
            raise ValueError(f"{GRID * GRID} patches expected, got {patches.shape[-2]}")
        out = torch.cat((turned(patches[..., :half], pos[axes[0]]), turned(patches[..., half:], pos[axes[1]])), dim=-1)
        return torch.cat((t[:, :, :PREFIX], out), dim=2)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotate(q, self.q_axes), self.rotate(k, self.k_axes)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, scale=1 / math.sqrt(q.shape[-1]))
        return self.o_proj(merge(y))


class GridRotaryAxesCrossed(GridRotaryBlock):
    """Planted: k's halves turned by the other axis than q's (column first): no function of any offset."""

    k_axes = ("col", "row")


CORRECT = ["GridBiasBlock", "GridRotaryBlock"]
PLANTED = {"GridRotaryAxesCrossed": "relative"}
