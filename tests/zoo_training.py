"""Blocks for the training-time checks: correct twins that must pass, and one planted bug each of the classes real
projects shipped (wrong custom backwards, detached paths, recomputes with other dropout masks, deferred init, unsaved
state, half-precision positions, frozen or untied parameters). Each bug is `TrainBlock` (or a twin) with one thing
changed; constructors take tblock's keywords, so `--block tests/zoo_training.py:NAME` builds it."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def heads(t, n):  # (B, T, C) -> (B, nh, T, hs)
    B, T, C = t.shape
    return t.view(B, T, n, C // n).transpose(1, 2)


def merge(t):  # (B, nh, T, hs) -> (B, T, C)
    B, nh, T, hs = t.shape
    return t.transpose(1, 2).reshape(B, T, nh * hs)


def attend(block, h, mask=None, bias=None, scale=None, cap=None):
    """Attention over block's q/k/v/o projections and rotary written out: scores scaled (1/sqrt(d_head) unless given),
    soft-capped at cap, plus an additive bias, a boolean mask (True = attend; causal unless given), softmax, dropout."""
    q, k, v = (heads(p(h), block.n_heads) for p in (block.q_proj, block.k_proj, block.v_proj))
    q, k = block.rotary(q), block.rotary(k)
    T = h.shape[1]
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if bias is not None:
        scores = scores + bias
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return block.o_proj(merge(F.dropout(scores.softmax(-1), block.p, block.training) @ v))


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """RoPE whose inv_freq (not saved: derived) is recomputed by reset_parameters, so a meta-device build that runs
    the init gets it back; angles in float32 whatever the module's dtype."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self, device=None):
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)

    def reset_parameters(self):
        with torch.no_grad():
            self.inv_freq.copy_(self.frequencies(self.inv_freq.device))

    def angles(self, T, device):  # (T, hs / 2)
        return torch.outer(torch.arange(T, device=device, dtype=torch.float32), self.inv_freq.float())

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class TrainBlock(nn.Module):
    """Llama-style Pre-norm block with dropout: RMSNorm, rotary SDPA attention, SwiGLU FFN."""

    rotary_class = Rotary
    norm_class = RMSNorm

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__()
        self.n_heads, self.causal, self.p = n_heads, causal, dropout
        hidden = int(8 * d_model / 3)
        self.attn_norm, self.ffn_norm = self.norm_class(d_model), self.norm_class(d_model)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.rotary = self.rotary_class(d_model // n_heads)
        self.w1, self.w3 = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))

    def ffn(self, h):
        return self.drop(self.w2(F.silu(self.w1(h)) * self.w3(h)))

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------- correct twins


class ReLUBlock(TrainBlock):
    """A ReLU FFN: kinks everywhere, the derivative check must not mistake them for a wrong backward."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3  # no gate

    def ffn(self, h):
        return self.drop(self.w2(F.relu(self.w1(h))))


class MoEBlock(TrainBlock):
    """Top-2 routing over 4 experts (softmax, then top-k, renormalised): the output jumps where routing switches."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3  # the experts are the FFN
        self.router = nn.Linear(d_model, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))
                                     for _ in range(4))

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        top, idx = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            weight = (top * (idx == e)).sum(-1, keepdim=True)
            out = out + weight * expert(h)
        return self.drop(out)


class _RMSNormFn(torch.autograd.Function):
    """A fused RMSNorm with a hand-written backward: y = x * r * w, r = (mean(x^2) + eps)^-1/2."""

    @staticmethod
    def forward(ctx, x, w, eps):
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # squared in float32 at least: no fp16 overflow
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
        ctx.save_for_backward(x, w, r)
        return x * r * w

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        gn = g * w  # gradient at the normalised x
        # d/dx [x r] = r (gn - x r^2 mean(gn x))
        gx = r * (gn - x * r.pow(2) * (gn * x).mean(-1, keepdim=True))
        gw = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
        return gx, gw, None


class FusedNorm(RMSNorm):
    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, self.eps)


class FusedNormBlock(TrainBlock):
    """RMSNorm through a custom autograd.Function with a correct backward."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = FusedNorm(d_model), FusedNorm(d_model)


class CheckpointedBlock(TrainBlock):
    """Its own checkpointing switch, done right: non-reentrant, the RNG state preserved for the recompute."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.use_checkpoint = False

    def forward(self, x):
        if self.use_checkpoint and self.training:
            x = x + checkpoint(lambda h: self.drop(self.attention(self.attn_norm(h))), x, use_reentrant=False)
            return x + checkpoint(lambda h: self.ffn(self.ffn_norm(h)), x, use_reentrant=False)
        return super().forward(x)


class TiedBlock(TrainBlock):
    """q and v share one matrix, tied the right way (one Parameter object)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.v_proj.weight = self.q_proj.weight


class BareRMSNorm(RMSNorm):
    reset_parameters = None  # as most single-file models write it: a weight of ones, no init of its own


class NoInitRotary(Rotary):
    reset_parameters = None  # inv_freq from __init__ only, the common idiom


class IdiomRoPE(TrainBlock):
    """The single-file idiom: inv_freq computed in __init__ (persistent=False), norms without an init of their own.
    Not built for deferred init at all (its norm weights come back unset too): meta_init has nothing to judge."""

    rotary_class = NoInitRotary

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = BareRMSNorm(d_model), BareRMSNorm(d_model)


CORRECT = ["TrainBlock", "ReLUBlock", "MoEBlock", "FusedNormBlock", "CheckpointedBlock", "TiedBlock", "IdiomRoPE"]


# ----------------------------------------------------------------------------- planted bugs


class _WrongRMSNormFn(_RMSNormFn):
    @staticmethod
    def backward(ctx, g):  # the mean(gn x) term forgotten: right only where the norm's scale does not move
        x, w, r = ctx.saved_tensors
        return g * w * r, (g * x * r).reshape(-1, x.shape[-1]).sum(0), None


class WrongNorm(FusedNorm):
    def forward(self, x):
        return _WrongRMSNormFn.apply(x, self.weight, self.eps)


class WrongNormBackward(TrainBlock):
    """A fused RMSNorm whose hand-written backward misses a term (quack PR #53's class: finite, non-zero, wrong)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.ffn_norm = WrongNorm(d_model)


class DetachedBranch(TrainBlock):
    """The attention branch reads a detached copy of its input: its parameters train, the stream below never
    learns from attention."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x).detach()))
        return x + self.ffn(self.ffn_norm(x))


class DataInPath(TrainBlock):
    """`.data` on the FFN's input: the same silent cut as a detach, written the old way."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x).data)


class CheckpointNoRng(TrainBlock):
    """The FFN under activation checkpointing with preserve_rng_state=False: the recompute draws other dropout
    masks, so gradients belong to another sample than the loss (OLMo-core PR #828)."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + checkpoint(lambda h: self.ffn(self.ffn_norm(h)), x, use_reentrant=False, preserve_rng_state=False)


class OwnCheckpointNoRng(CheckpointedBlock):
    """Its own switch (off by default) recomputes with preserve_rng_state=False: wrong only when turned on."""

    def forward(self, x):
        if self.use_checkpoint and self.training:
            x = x + self.drop(self.attention(self.attn_norm(x)))
            return x + checkpoint(lambda h: self.ffn(self.ffn_norm(h)), x, use_reentrant=False, preserve_rng_state=False)
        return TrainBlock.forward(self, x)


class ReentrantInside(TrainBlock):
    """The whole body under reentrant checkpointing: with an input that does not require grad (frozen embeddings
    before it), no parameter gets a gradient."""

    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=True)


class RotaryInitOnly(TrainBlock):
    """inv_freq registered persistent=False and computed only in __init__ (transformers issue #45902): after a
    meta-device build and to_empty() nothing recomputes it."""

    rotary_class = NoInitRotary


class PlainTensorAttr(TrainBlock):
    """A random mixing matrix kept as a plain attribute: not saved, not moved by .to()."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.mix = torch.randn(d_model, d_model) / math.sqrt(d_model)

    def forward(self, x):
        return super().forward(x) + 0.1 * x @ self.mix.to(x)


class ListParams(TrainBlock):
    """Per-sublayer gains in a Python list: never registered, so never trained and never saved."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gains = [nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.ones(d_model))]

    def forward(self, x):
        x = x + self.gains[0] * self.drop(self.attention(self.attn_norm(x)))
        return x + self.gains[1] * self.ffn(self.ffn_norm(x))


class UnsavedBuffer(TrainBlock):
    """A random projection registered persistent=False: a fresh instance loaded from the state_dict keeps its own."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("mix", torch.randn(d_model, d_model) / math.sqrt(d_model), persistent=False)

    def forward(self, x):
        return super().forward(x) + 0.1 * x @ self.mix


class HalfPositions(Rotary):
    def angles(self, T, device):  # positions in inv_freq's dtype: after .to(bfloat16) only 8 bits of position
        t = torch.arange(T, device=device, dtype=self.inv_freq.dtype)
        return torch.outer(t, self.inv_freq).float()


class Bf16Positions(TrainBlock):
    """Rotary positions built in the buffers' dtype: exact in float32, steps of 2 past 256 after .to(bfloat16)."""

    rotary_class = HalfPositions


class MatmulAngles(Rotary):
    def angles(self, T, device):  # a matmul: under autocast it runs in bfloat16 (HF disables autocast here)
        t = torch.arange(T, device=device, dtype=torch.float32)
        return (t[:, None] @ self.inv_freq.float()[None, :]).float()


class AutocastAngles(TrainBlock):
    """Rotary angles from a matmul that autocast runs in bfloat16: positions lost under mixed precision."""

    rotary_class = MatmulAngles


class FrozenNorm(TrainBlock):
    """The FFN norm's weight frozen by mistake (requires_grad=False)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.ffn_norm.weight.requires_grad_(False)


class TieBrokenByCopy(TrainBlock):
    """q and k meant to share one matrix, 'tied' by copying values: equal at build, apart after one step."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.k_proj.weight = nn.Parameter(self.q_proj.weight.detach().clone())


class _Flip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class NegatedGradient(TrainBlock):
    """A custom op on the FFN's output whose backward flips the sign: training climbs the loss."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return _Flip.apply(x + self.ffn(self.ffn_norm(x)))


# planted block -> the check meant to catch it
PLANTED = {
    "WrongNormBackward": "derivative", "DetachedBranch": "derivative", "DataInPath": "derivative",
    "CheckpointNoRng": "derivative", "NegatedGradient": "optimizer_step",
    "OwnCheckpointNoRng": "checkpointing", "ReentrantInside": "checkpointing",
    "RotaryInitOnly": "meta_init",
    "PlainTensorAttr": "state_dict", "ListParams": "state_dict", "UnsavedBuffer": "state_dict",
    "Bf16Positions": "precision", "AutocastAngles": "precision",
    "FrozenNorm": "optimizer_step", "TieBrokenByCopy": "optimizer_step",
}
