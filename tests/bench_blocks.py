"""Blocks for bench's edge cases: nothing to train, no gradient path at all, a decode of the wrong shape."""

import torch.nn as nn
import torch.nn.functional as F


class NoParams(nn.Module):
    """Parameter-free attention plus a residual: a correct block with nothing to train."""

    def __init__(self, d_model=32, n_heads=4, **_):
        super().__init__()

    def forward(self, x):
        return x + F.scaled_dot_product_attention(x, x, x)


class Detached(nn.Module):
    """No parameters and an output cut off from the input: train mode has no backward at all."""

    def __init__(self, d_model=32, n_heads=4, **_):
        super().__init__()

    def forward(self, x):
        return x.detach() * 2


class BadDecode(nn.Module):
    """decode() returns one number per sequence instead of one vector per new token."""

    def __init__(self, d_model=32, n_heads=4, causal=True, **_):
        super().__init__()
        self.lin = nn.Linear(d_model, d_model)

    def forward(self, x):
        return x + self.lin(x)

    def decode(self, x_t, cache):
        return self.lin(x_t)[:, :1, :1], cache
