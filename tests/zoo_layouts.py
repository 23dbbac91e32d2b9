"""Correct blocks whose weights are laid out unusually: several projections as row ranges of one matrix."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SlicedQKVO(nn.Module):
    """Correct (modded-nanogpt's layout): q, k, v and the output projection are row ranges of one matrix, each used by
    F.linear on its own slice; the q, k, v rows are scaled by a learned scalar first (modded's sa_lambdas), and the
    FFN's two matrices are one parameter chunked in two (relu^2)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=256):
        super().__init__()
        self.d, self.h = d_model, n_heads
        self.qkvo_w = nn.Parameter(torch.randn(4 * d_model, d_model) * d_model ** -0.5)
        self.lam = nn.Parameter(torch.tensor(0.5))
        self.mlp_w = nn.Parameter(torch.randn(2 * d_ff, d_model) * d_model ** -0.5)

    def forward(self, x):
        B, T, d = x.shape
        h = F.rms_norm(x, (d,))
        qkv = F.linear(h, self.lam * self.qkvo_w[: 3 * d]).view(B, T, 3 * self.h, d // self.h).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + F.linear(y, self.qkvo_w[3 * d :])
        w_in, w_out = self.mlp_w.chunk(2)
        return x + F.linear(F.relu(F.linear(F.rms_norm(x, (d,)), w_in)).square(), w_out.t())
