"""Correct blocks laid out unusually: several projections as row ranges of one matrix (modded-nanogpt); q scaled
before a rotate-half rotary, scores by bmm over (B * H, T, d_head) (ESM-2)."""

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


class ConcatenatedQKV(nn.Module):
    """Correct: q's and the key/value's weights kept apart and concatenated on the fly into one F.linear
    (`torch.cat([wq, wkv])`), the FFN's in matrix likewise from two halves used as `x @ W.T`."""

    def __init__(self, d_model=64, n_heads=4, d_ff=256):
        super().__init__()
        self.h = n_heads
        self.wq = nn.Parameter(torch.randn(d_model, d_model) * d_model ** -0.5)
        self.wkv = nn.Parameter(torch.randn(2 * d_model, d_model) * d_model ** -0.5)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.up_a = nn.Parameter(torch.randn(d_ff // 2, d_model) * d_model ** -0.5)
        self.up_b = nn.Parameter(torch.randn(d_ff // 2, d_model) * d_model ** -0.5)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        qkv = F.linear(F.rms_norm(x, (d,)), torch.cat([self.wq, self.wkv]))
        q, k, v = qkv.view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.o(y)
        return x + self.down(F.gelu(F.rms_norm(x, (d,)) @ torch.cat((self.up_a, self.up_b), 0).T))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ScaledBeforeRotateHalf(nn.Module):
    """Correct (ESM-2's attention): q *= d_head ** -0.5 in place, then a rotate-half rotary (q.chunk(2, -1), its
    halves negated and concatenated), softmax(bmm(q, k^T)) over (B * H, T, d_head). `scaled=False`: the bug, unscaled."""

    def __init__(self, d_model=64, n_heads=4, scaled=True):
        super().__init__()
        self.h, self.hd, self.scaled = n_heads, d_model // n_heads, scaled
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd)))

    def forward(self, x):
        B, T, d = x.shape
        h = self.ln1(x)
        q = self.q(h)
        if self.scaled:
            q *= self.hd ** -0.5
        q, k, v = (t.view(B, T, self.h, self.hd).transpose(1, 2).reshape(B * self.h, T, self.hd) for t in (q, self.k(h), self.v(h)))
        # positions and angles in float32 whatever the run's dtype (ESM-2's own type_as(inv_freq) makes them bfloat16
        # after .to(bfloat16): inexact past 256 tokens, which `relative` names)
        f = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), self.inv_freq.float())
        cos, sin = torch.cat((f, f), dim=-1).cos()[None].to(x.dtype), torch.cat((f, f), dim=-1).sin()[None].to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v)
        x = x + self.o(y.view(B, self.h, T, self.hd).transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ProjectedMemory(nn.Module):
    """Correct: learned memory slots (Memory Transformer, all-attention's persistent memory) passed through the same
    key and value projections as the normalised stream and put in front of its keys and values; every query sees
    them (after the sequence's keys here). A key projection called on them reads constants, not an un-normalised
    stream."""

    def __init__(self, d_model=64, n_heads=4, slots=4):
        super().__init__()
        self.h, self.hd, self.slots = n_heads, d_model // n_heads, slots
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
        self.memory = nn.Parameter(torch.randn(slots, d_model))

    def forward(self, x):
        B, T, d = x.shape
        split = lambda t: t.view(B, -1, self.h, self.hd).transpose(1, 2)  # noqa: E731
        h, mem = self.ln1(x), self.memory.expand(B, -1, -1)
        q = split(self.q(h))
        k, v = (torch.cat([split(p(h)), split(p(mem))], 2) for p in (self.k, self.v))  # the memory's call last
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=x.device).tril(),
                          torch.ones(T, self.slots, dtype=torch.bool, device=x.device)], -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
