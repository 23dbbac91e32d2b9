"""Blocks for testing the battery: correct ones that must pass, and ones with one planted bug each.

Every buggy block is the correct `Good` block with one thing changed; the constructor takes tblock's
keywords (d_model, n_heads, d_ff, dropout, causal) so `--block tests/zoo.py:NAME` builds it.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Good(nn.Module):
    """A correct Pre-LN block written out by hand: MHA with need_weights=False, GELU FFN."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.1, causal=False, eps=1e-5):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.causal = causal
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))

    def mask(self, T, device):
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(1) if self.causal else None

    def sa(self, h, pad_mask, need_weights=False):
        return self.attn(h, h, h, key_padding_mask=pad_mask, attn_mask=self.mask(h.shape[1], h.device), need_weights=need_weights)[0]

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(self.ln2(x))


# ----------------------------------------------------------------------------- correct blocks


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Llama-style: RMSNorm, SDPA attention (causal), SwiGLU FFN of width 8/3 d, no biases."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        hidden = 256 * math.ceil(int(8 * d_model / 3) / 256) if d_model >= 256 else int(8 * d_model / 3)
        self.attn_norm = RMSNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = RMSNorm(d_model)
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device)
        if self.causal:
            allowed = allowed.tril()
        allowed = allowed[None, None]
        if pad_mask is not None:
            allowed = allowed & ~pad_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def TorchPreLN(d_model=64, n_heads=4, d_ff=None, dropout=0.1):
    return nn.TransformerEncoderLayer(d_model, n_heads, d_ff or 4 * d_model, dropout, batch_first=True, norm_first=True)


def TorchPostLN(d_model=64, n_heads=4, d_ff=None, dropout=0.1):
    return nn.TransformerEncoderLayer(d_model, n_heads, d_ff or 4 * d_model, dropout, batch_first=True, norm_first=False)


# ----------------------------------------------------------------------------- planted bugs


class NoResidual(Good):
    def forward(self, x, pad_mask=None):
        x = self.sa(self.ln1(x), pad_mask)  # bug: the attention residual is gone
        return x + self.ffn(self.ln2(x))


class NoFFNResidual(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return self.ffn(self.ln2(x))  # bug: the FFN residual is gone


class UnusedLayer(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.proj = nn.Linear(self.ln1.normalized_shape[0], self.ln1.normalized_shape[0])  # bug: never called


class FrozenBranch(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        with torch.no_grad():  # bug: the FFN never trains
            h = self.ffn(self.ln2(x))
        return x + h


class DetachedInput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x.detach(), pad_mask)  # bug: no gradient reaches the caller


class PaddingIgnored(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, None)  # bug: accepts the mask, never passes it


class PaddingInverted(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, None if pad_mask is None else ~pad_mask)  # bug: True = keep


class BatchFirstMixup(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.attn.batch_first = False  # bug: attends across the batch axis

    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


class BatchMeanLeak(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + 0.1 * x.mean(0, keepdim=True)  # bug: a batch statistic


class BatchNormLeak(Good):
    """Leaks only in train mode (BatchNorm's batch statistics); eval uses running stats."""

    def __init__(self, d_model=64, *a, **k):
        super().__init__(d_model, *a, **k)
        self.bn = nn.BatchNorm1d(d_model)

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)  # bug: normalises across the batch
        return x + self.ffn(h)


class DropoutInEval(Good):
    def forward(self, x, pad_mask=None):
        return F.dropout(super().forward(x, pad_mask), 0.1, training=True)  # bug: ignores self.training


class NoiseInEval(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + 1e-3 * torch.randn_like(x)  # bug: random in eval


class InputMutated(Good):
    def forward(self, x, pad_mask=None):
        x += self.sa(self.ln1(x), pad_mask)  # bug: in-place on the caller's tensor
        return x + self.ffn(self.ln2(x))


class InputScaledInPlace(Good):
    def forward(self, x, pad_mask=None):
        x.mul_(1.0001)  # bug: a tiny in-place rescale of the input
        return super().forward(x, pad_mask)


class EpsZero(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **{**k, "eps": 0.0})  # bug: NaN on a constant token


class PostLNEpsZero(Good):
    """Post-LN whose norms have eps=0: a constant input token does not reach a norm constant."""

    def __init__(self, *a, **k):
        super().__init__(*a, **{**k, "eps": 0.0})

    def forward(self, x, pad_mask=None):
        x = self.ln1(x + self.sa(x, pad_mask))
        return self.ln2(x + self.ffn(x))


class WrongShape(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask)[:, -1]  # bug: last token only, (B, d)


class TransposedOutput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask).transpose(0, 1)  # bug: (T, B, d)


class NeedWeightsOn(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask, need_weights=True)  # bug: weights computed, dropped
        return x + self.ffn(self.ln2(x))


class NotCausal(Good):
    def mask(self, T, device):
        return None  # bug: claims causal, masks nothing


class CausalOffByOne(Good):
    def mask(self, T, device):
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(2)  # bug: sees t + 1


class NaNForward(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + torch.sqrt(x.sum(-1, keepdim=True) - 1e9)  # bug: sqrt of negative


class LargeInputOverflow(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + torch.exp(x).mean(-1, keepdim=True) * 0  # bug: exp overflows on large input


class NoGradParams(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(self.ln2(x)).detach()  # bug: the FFN's gradient is cut


class Counter(Good):
    """Output depends on how many times it was called: eval is not a pure function."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, pad_mask=None):
        self.calls += 1  # bug: state that changes the output
        return super().forward(x, pad_mask) + 1e-2 * self.calls


class SoftmaxOverQueries(LlamaBlock):
    """Attention normalised over the query axis: each key's weights sum to 1, so the future leaks."""

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.n_heads)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
        w = scores.softmax(dim=-2).nan_to_num(0.0)  # bug: softmax over queries, not keys
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, T, C))


class PrecisionLoss(Good):
    """Adds and removes a large offset: exact in float64, ~1e-3 absolute error in float32."""

    def forward(self, x, pad_mask=None):
        return (super().forward(x, pad_mask) + 1e4) - 1e4  # bug: catastrophic cancellation


class ExtraParams(Good):
    """A learned position table (512 x d) outside attention, FFN and norms: the FFN share is off."""

    def __init__(self, d_model=64, *a, **k):
        super().__init__(d_model, *a, **k)
        self.pos = nn.Parameter(torch.randn(512, d_model) * 0.02)

    def forward(self, x, pad_mask=None):
        return super().forward(x + self.pos[: x.shape[1]], pad_mask)


class NoPadKeyword(nn.Module):
    """Correct, but its forward takes no padding mask: the padding check must skip, not fail."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.inner = Good(d_model, n_heads)

    def forward(self, x):
        return self.inner(x)


class ReturnsDict(Good):
    def forward(self, x, pad_mask=None):
        return {"out": super().forward(x, pad_mask)}  # not a tensor: a load error, exit 2


class BrokenForward(Good):
    def forward(self, x, pad_mask=None):
        raise RuntimeError("boom")


class FailsWithGrad(Good):
    """Loads fine (the probe runs under no_grad) but raises when autograd records: a measuring failure."""

    def forward(self, x, pad_mask=None):
        if torch.is_grad_enabled():
            raise RuntimeError("grad path broken")
        return super().forward(x, pad_mask)


class AttentionOnly(nn.Module):
    """A residual attention layer and no FFN: params must omit the FFN share, with a note."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        h = self.norm(x)
        return x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]


def factory_raises(d_model=64):
    raise ValueError("bad width")


def not_a_module(d_model=64):
    return 42


# The bug each planted block carries, and the check that must fail on it (extra flags for the run).
PLANTED = {
    "NoResidual": ("residual", {}),
    "NoFFNResidual": ("residual", {}),
    "UnusedLayer": ("grad_params", {}),
    "FrozenBranch": ("grad_params", {}),
    "NoGradParams": ("grad_params", {}),
    "DetachedInput": ("grad_input", {}),
    "PaddingIgnored": ("padding", {}),
    "PaddingInverted": ("padding", {}),
    "BatchFirstMixup": ("batch", {}),
    "BatchMeanLeak": ("batch", {}),
    "BatchNormLeak": ("batch", {}),
    "DropoutInEval": ("determinism", {}),
    "NoiseInEval": ("determinism", {}),
    "Counter": ("determinism", {}),
    "InputMutated": ("input_unchanged", {}),
    "InputScaledInPlace": ("input_unchanged", {}),
    "EpsZero": ("finite", {}),
    "PostLNEpsZero": ("finite", {}),
    "NaNForward": ("finite", {}),
    "LargeInputOverflow": ("finite", {}),
    "WrongShape": ("shape", {}),
    "TransposedOutput": ("shape", {}),
    "NotCausal": ("causal", {"causal": True}),
    "CausalOffByOne": ("causal", {"causal": True}),
    "SoftmaxOverQueries": ("causal", {"causal": True}),
    "PrecisionLoss": ("dtype", {}),
}
# Warnings, failures only under --strict: need_weights left on (issue #2 asks for a warning), and
# parameters outside attention, FFN and norms (not wrong in itself, but the 2/3 rule no longer reads).
WARNED = {"NeedWeightsOn": "need_weights", "ExtraParams": "ffn_share"}
CORRECT = {"Good": {}, "LlamaBlock": {"causal": True}, "TorchPreLN": {}, "TorchPostLN": {}, "NoPadKeyword": {}}
