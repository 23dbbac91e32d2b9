"""Mixture-of-experts blocks written the way users write them (a list of expert modules, a linear router, a loop over
experts), with one routing choice planted at a time, for the moe entries of the spec card."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Expert(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routes each token to top_k of n_experts.
    router: softmax | sigmoid; order: 'before' (score all experts, then top-k) or 'after' (top-k of the logits, then
    softmax over them); renorm: the chosen weights divided by their sum; scale: a constant on the weights;
    shared: a shared expert every token goes through, gated by sigmoid(linear) where shared_gate."""

    def __init__(self, d, f, n_experts=8, top_k=2, router="softmax", order="before", renorm=True, scale=1.0,
                 shared=False, shared_gate=True, zero_router=False):
        super().__init__()
        self.top_k, self.router, self.order, self.renorm, self.scale = top_k, router, order, renorm, scale
        self.gate = nn.Linear(d, n_experts, bias=False)
        if zero_router:  # as Qwen2-MoE's router is constructed (its model's init then draws it)
            nn.init.zeros_(self.gate.weight)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(n_experts))
        self.shared = Expert(d, f) if shared else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if shared and shared_gate else None

    def weights(self, logits):
        if self.router == "sigmoid":
            scores = torch.sigmoid(logits)
            w, idx = torch.topk(scores, self.top_k, dim=-1)
        elif self.order == "after":
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            w = F.softmax(top, dim=-1)
        else:
            w, idx = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        return w * self.scale, idx

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        w, idx = self.weights(self.gate(h))
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, w[tok, slot, None] * expert(h[tok]))
        if self.shared is not None:
            s = self.shared(h)
            out = out + (torch.sigmoid(self.shared_gate(h)) * s if self.shared_gate is not None else s)
        return out.reshape(B, T, D)


class StackedMoE(MoE):
    """The same routing with the experts' SwiGLU matrices stacked on an expert axis, each token's chosen experts
    gathered and applied by einsum (no expert can be called alone)."""

    def __init__(self, d, f, n_experts=8, **kw):
        super().__init__(d, f, n_experts, **kw)
        del self.experts
        self.w1 = nn.Parameter(torch.randn(n_experts, f, d) / math.sqrt(d))
        self.w3 = nn.Parameter(torch.randn(n_experts, f, d) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(n_experts, d, f) / math.sqrt(f))

    def forward(self, x):
        B, T, D = x.shape
        h = x.reshape(-1, D)
        w, idx = self.weights(self.gate(h))  # (N, k)
        a = F.silu(torch.einsum("nd,nkfd->nkf", h, self.w1[idx])) * torch.einsum("nd,nkfd->nkf", h, self.w3[idx])
        y = torch.einsum("nkf,nkdf->nkd", a, self.w2[idx])
        out = (w[..., None] * y).sum(1)
        if self.shared is not None:
            s = self.shared(h)
            out = out + (torch.sigmoid(self.shared_gate(h)) * s if self.shared_gate is not None else s)
        return out.reshape(B, T, D)


class NormedMoE(nn.Module):
    """A mixture module that takes the raw stream and does its own norm and residual: x + moe(norm(x))."""

    def __init__(self, d, f, **moe):
        super().__init__()
        self.norm = RMSNorm(d)
        self.inner = MoE(d, f, **moe)

    def forward(self, x):
        return x + self.inner(self.norm(x))


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.h = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(D // self.h)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class MoEBlock(nn.Module):
    """A pre-norm decoder block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64, **moe):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        stacked = moe.pop("stacked", False)
        self.moe = (StackedMoE if stacked else MoE)(d_model, d_ff, **moe)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class InnerResidualBlock(nn.Module):
    """The mixture module holds the FFN's norm and residual add (its output is the stream)."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64, **moe):
        super().__init__()
        self.ln1 = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.moe = NormedMoE(d_model, d_ff, **moe)

    def forward(self, x):
        return self.moe(x + self.attn(self.ln1(x)))


class FlatBlock(nn.Module):
    """Router and experts held by the block itself (no mixture module): read at the block's output."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64, renorm=True):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.router = nn.Linear(d_model, 8, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(8))
        self.renorm = renorm

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        w, idx = torch.topk(F.softmax(self.router(h), -1), 2, dim=-1)  # (B, T, 2)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            hit = (idx == e)  # (B, T, 2)
            if hit.any():
                out = out + (w * hit).sum(-1, keepdim=True) * expert(h)
        return x + out


class DenseBlock(nn.Module):
    """The same block with one SwiGLU FFN: no experts."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ffn = Expert(d_model, d_ff)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class HeadsListBlock(nn.Module):
    """Attention as a list of identical per-head modules and a linear to one output per head (a per-head gate): not a
    mixture of experts, since nothing selects among the heads."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d_model, d_model // n_heads, bias=False) for _ in range(n_heads))
        self.head_gate = nn.Linear(d_model, n_heads, bias=False)
        self.ffn = Expert(d_model, d_ff)

    def forward(self, x):
        g = torch.sigmoid(self.head_gate(x))  # (B, T, H)
        y = torch.cat([g[..., i: i + 1] * h(x) for i, h in enumerate(self.heads)], -1)
        x = x + y
        return x + self.ffn(x)
