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
        h = x.float()  # squared in float32, as Llama's: an fp16 square overflows above |x| ~ 256
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


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
        # positions counted from each sample's first real token, so left padding moves none (its one bug is the share)
        pos = torch.arange(x.shape[1], device=x.device) if pad_mask is None else ((~pad_mask).long().cumsum(-1) - 1).clamp(min=0)
        return super().forward(x + self.pos[pos], pad_mask)


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


# ----------------------------------------------------------------------------- second generation
# Correct blocks written the ways people write them: opaque names, hand-written attention, nesting,
# GPT-2's Conv1D. Each takes a padding mask under some name (or none) and, where it can, `causal`.


def heads(t, n):  # (B, T, C) -> (B, nh, T, hs)
    B, T, C = t.shape
    return t.view(B, T, n, C // n).transpose(1, 2)


def merge(t):  # (B, nh, T, hs) -> (B, T, C)
    B, H, T, D = t.shape
    return t.transpose(1, 2).reshape(B, T, H * D)


def allowed_mask(T, device, causal, pad_mask=None):
    """(B or 1, 1, T, T) bool, True = may attend."""
    a = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        a = a.tril()
    a = a[None, None]
    if pad_mask is not None:
        a = a & ~pad_mask[:, None, None, :]
    return a


class OpaqueNames(nn.Module):
    """Pre-LN with projections called w_a..w_d, SDPA attention, an MLP called f/g."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=False):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.n, self.causal = n_heads, causal
        self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.w_a, self.w_b, self.w_c, self.w_d = (nn.Linear(d_model, d_model) for _ in range(4))
        self.f, self.g = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))
        x = x + self.w_d(merge(y))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class HandSoftmax(nn.Module):
    """Pre-LN with a fused qkv, softmax(QK^T / sqrt(d_head)) V written out, a ReLU MLP called net."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=False, prescale=False):
        super().__init__()
        self.n, self.causal, self.prescale = n_heads, causal, prescale
        self.norm_a, self.norm_b = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.o = nn.Linear(d_model, d_model)
        self.net = nn.Sequential(nn.Linear(d_model, d_ff or 4 * d_model), nn.ReLU(), nn.Linear(d_ff or 4 * d_model, d_model))

    def scores(self, q, k):
        if self.prescale:
            return (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        return merge(s.softmax(dim=-1) @ v)

    def forward(self, x, mask=None):
        x = x + self.o(self.attend(self.norm_a(x), mask))
        return x + self.net(self.norm_b(x))


def HandSoftmaxPrescaled(d_model=64, n_heads=4, d_ff=None, causal=False):
    """q scaled by d_head^-1/2 before the product (as many code bases do): as correct as scaling after."""
    return HandSoftmax(d_model, n_heads, d_ff, causal, prescale=True)


class XAttention(nn.Module):
    def __init__(self, dim, heads_):
        super().__init__()
        self.heads = heads_
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):  # mask: True = keep (x-transformers' convention)
        q, k, v = (heads(f(x), self.heads) for f in (self.to_q, self.to_k, self.to_v))
        s = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], -torch.finfo(s.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", s.softmax(dim=-1), v)
        return self.to_out(merge(out))


class XFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU()), nn.Dropout(0.0), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class XEncoder(nn.Module):
    """x-transformers' layout: layers = ModuleList of [norm, block] pairs, to_q/to_k/to_v/to_out, mask True = keep."""

    def __init__(self, dim=64, heads=4, depth=1):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), XAttention(dim, heads)]))
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), XFeedForward(dim)]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for norm, fn in self.layers:
            x = x + (fn(norm(x), mask=mask) if isinstance(fn, XAttention) else fn(norm(x)))
        return self.final_norm(x)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a Linear with its weight transposed, computed with addmm."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.nf,))


class GPT2Style(nn.Module):
    """GPT-2's block: ln_1, c_attn (fused, Conv1D), c_proj, ln_2, mlp.c_fc/c_proj with tanh-GELU; causal."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.n, self.causal = n_heads, causal
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.c_attn, self.c_proj = Conv1D(3 * d_model, d_model), Conv1D(d_model, d_model)
        self.mlp = nn.ModuleDict({"c_fc": Conv1D(4 * d_model, d_model), "c_proj": Conv1D(d_model, 4 * d_model)})

    def forward(self, x, attention_mask=None):  # attention_mask: 1 = keep (HF's convention)
        h = self.ln_1(x)
        q, k, v = (heads(t, self.n) for t in self.c_attn(h).split(x.shape[-1], dim=2))
        pad = None if attention_mask is None else ~attention_mask.bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad))
        x = x + self.c_proj(merge(y))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) of (B, nh, T, hs) queries and keys."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, t):
        T = t.shape[-2]
        # angles in float32 whatever the module's dtype: a bf16 inv_freq holds positions exactly only up to 256
        freqs = torch.outer(torch.arange(T, device=t.device, dtype=torch.float32), self.inv_freq.float())
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class RoPEBlock(LlamaBlock):
    """Llama-style with rotary positions: token order matters by design (order skips: positions inside)."""

    def __init__(self, d_model=64, n_heads=4, causal=False):
        super().__init__(d_model, n_heads, causal)
        self.rotary = Rotary(d_model // n_heads)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask))
        return self.o_proj(merge(y))


class XKeepMask(XEncoder):
    """x-transformers-style, mask True = keep, padded query rows zeroed: correct with --pad-keyword mask --pad-means keep."""

    def forward(self, x, mask=None):
        out = super().forward(x, mask)
        return out if mask is None else out * mask[..., None]


# ---- planted bugs, second generation: each is a correct block above with one thing changed


class HeadsNoTranspose(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))
        x = x + self.w_d(y.reshape(x.shape))  # bug: (B, nh, T, hs) reshaped without transposing back
        return x + self.g(F.gelu(self.f(self.n2(x))))


class HeadsNoTransposeNoMask(HeadsNoTranspose):
    def forward(self, x):
        return super().forward(x)


class TokenShift(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.gelu(self.f(self.n2(x).roll(1, dims=1))))  # bug: tokens shifted in the FFN path


class TokenShiftNoMask(TokenShift):
    def forward(self, x):
        return super().forward(x)


class Unscaled(HandSoftmax):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)  # bug: no 1/sqrt(d_head)


class UnscaledSDPA(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask), scale=1.0)  # bug
        x = x + self.w_d(merge(y))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class EvalSkipsFFN(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        if not self.training:
            return x  # bug: the FFN only runs in training
        return x + self.ffn(self.ln2(x))


class MaskPolarityZeroRows(XEncoder):
    """Documents pad_mask as True = padding but reads it as True = keep, and zeroes 'masked' query rows."""

    def forward(self, x, pad_mask=None):
        keep = pad_mask  # bug: wrong polarity
        out = super().forward(x, keep)
        if keep is None:
            return out
        return x + (out - x) * keep[..., None]


class CausalIgnoresPadding(Good):
    """Causal, takes pad_mask, drops it: right padding cannot show it, left padding does."""

    def forward(self, x, pad_mask=None):
        return super().forward(x, None)  # bug


class LinearFFN(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ffn[1] = nn.Identity()  # bug: no nonlinearity: the two Linears compose to one


class LinearFFNOpaque(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.dropout(self.f(self.n2(x)), 0.0, self.training))  # bug: dropout where the activation was


class PadMaskOnQueries(LlamaBlock):
    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[None, None] if self.causal else None
        if pad_mask is not None:
            rows = ~pad_mask[:, None, :, None]  # bug: masks query rows, not keys
            allowed = rows if allowed is None else allowed & rows
            allowed = allowed | ~rows.any(-2, keepdim=True)  # keep the row non-empty
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))


# The second generation: check that must flag each (fail, or warn that --strict fails) and its flags.
PLANTED_2 = {
    "HeadsNoTranspose": ("padding", {}),
    "HeadsNoTransposeNoMask": ("order", {}),
    "TokenShift": ("padding", {}),
    "TokenShiftNoMask": ("order", {}),
    "Unscaled": ("attention", {"d_model": 512, "n_heads": 8}),
    "UnscaledSDPA": ("attention", {}),
    "EvalSkipsFFN": ("train_eval", {}),
    "MaskPolarityZeroRows": ("padding", {}),
    "CausalIgnoresPadding": ("padding", {"causal": True}),
    "LinearFFN": ("ffn_share", {}),
    "LinearFFNOpaque": ("ffn_share", {}),
    "PadMaskOnQueries": ("padding", {}),
}
CORRECT.update({
    "OpaqueNames": {}, "HandSoftmax": {}, "HandSoftmaxPrescaled": {}, "XEncoder": {}, "GPT2Style": {"causal": True},
    "RoPEBlock": {}, "XKeepMask": {"pad_keyword": "mask", "pad_means": "keep"},
})


# ----------------------------------------------------------------------------- cached decoding
# decode(x_t, cache) -> (y_t, cache): x_t holds n >= 1 new tokens; cache is None at the start.


class CachedLlama(LlamaBlock):
    """Llama-style, causal, with a KV cache: the cache is (k, v) of shape (B, nh, T, hs)."""

    def qkv(self, h):
        return (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))

    def extend(self, cache, k, v):
        return (k, v) if cache is None else (torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2))

    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device).tril(T - n)  # new token i sits at T - n + i

    def attend_cached(self, h, cache):
        q, k, v = self.qkv(h)
        k, v = self.extend(cache, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed(h.shape[1], k.shape[2], h.device))
        return self.o_proj(merge(y)), (k, v)

    def decode(self, x, cache=None):
        a, cache = self.attend_cached(self.attn_norm(x), cache)
        x = x + a
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), cache


class CachedRoPE(RoPEBlock):
    """RoPE with a cache: new tokens are rotated at their absolute positions (the cache length)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)

    def rotate(self, t, start):
        T = t.shape[-2]
        pos = torch.arange(start, start + T, device=t.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.rotary.inv_freq.float())
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)

    def offset(self, cache):
        return 0 if cache is None else cache[0].shape[2]

    def decode(self, x, cache=None):
        h = self.attn_norm(x)
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        start = self.offset(cache)
        q, k = self.rotate(q, start), self.rotate(k, start)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        n, T = x.shape[1], k.shape[2]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, T, dtype=torch.bool, device=x.device).tril(T - n))
        x = x + self.o_proj(merge(y))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), (k, v)


class CacheWindow(CachedLlama):
    def extend(self, cache, k, v):
        k, v = super().extend(cache, k, v)
        return k[:, :, -8:], v[:, :, -8:]  # bug: a sliding window of 8 nobody asked for


class CacheKeyTwice(CachedLlama):
    def extend(self, cache, k, v):
        if cache is None:
            return k, v
        return torch.cat([cache[0], k, k], 2), torch.cat([cache[1], v, v], 2)  # bug: the new key and value appended twice

    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device).tril(T - n)


class CacheRoPEOffByOne(CachedRoPE):
    def offset(self, cache):
        return 0 if cache is None else cache[0].shape[2] - 1  # bug: positions off by one after the prefill


class CacheShared(CachedLlama):
    """Keeps its cache on the module: two sequences decoded in turns see each other's keys."""

    def decode(self, x, cache=None):
        if cache is None:
            self.store = None
        y, self.store = super().decode(x, getattr(self, "store", None))  # bug: the module's cache, not the caller's
        return y, ("token", self.store[0].shape[2])


class CacheChunkSeesFuture(CachedLlama):
    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device)  # bug: a chunk's tokens see the chunk's later tokens


class CacheGrowsGraph(CachedLlama):
    def decode(self, x, cache=None):
        with torch.enable_grad():  # bug: builds an autograd graph across steps even under no_grad
            return super().decode(x.requires_grad_(True) if not x.requires_grad else x, cache)


class CacheForgetsPrefill(CachedLlama):
    def extend(self, cache, k, v):
        if cache is not None and cache[0].shape[2] > 1 and k.shape[2] == 1:
            cache = (cache[0][:, :, -1:], cache[1][:, :, -1:])  # bug: only the prompt's last token is kept
        return super().extend(cache, k, v)


class CachePromptByLength(CachedLlama):
    """Keeps prompts' keys and values on the module, looked up by the prompt's length (a prefix cache never keyed by
    its tokens): a second sequence with a prompt as long as an earlier one's is given that one's."""

    def extend(self, cache, k, v):
        if cache is None:
            return self.__dict__.setdefault("prompts", {}).setdefault(k.shape[2], (k, v))  # bug: keyed by length alone
        return super().extend(cache, k, v)


CACHE_BUGS = ["CacheWindow", "CacheKeyTwice", "CacheRoPEOffByOne", "CacheShared", "CacheChunkSeesFuture", "CacheGrowsGraph",
              "CacheForgetsPrefill", "CachePromptByLength"]
CACHED_CORRECT = ["CachedLlama", "CachedRoPE"]


class AllocationFails(Good):
    """The CPU allocator's out-of-memory error, as PyTorch words it: an out-of-memory exit (2), not a block error."""

    def forward(self, x, pad_mask=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes")


class Printing(Good):
    """Prints on import of nothing, but in __init__ and forward: --json must stay valid JSON on stdout."""

    def __init__(self, *a, **k):
        print("building Printing")
        super().__init__(*a, **k)

    def forward(self, x, pad_mask=None):
        print("forward of Printing")
        return super().forward(x, pad_mask)


class QKNorm(LlamaBlock):
    """Per-head RMSNorm on q and k before the product (OLMo-2, Qwen3, Gemma 3): correct, and q/k keep their roles."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.q_norm, self.k_norm = RMSNorm(d_model // n_heads), RMSNorm(d_model // n_heads)

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(T, h.device, self.causal, pad_mask))
        return self.o_proj(merge(y))


class UnscaledQKNorm(QKNorm):
    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        s = (q @ k.transpose(-2, -1)).masked_fill(~allowed_mask(T, h.device, self.causal, pad_mask), float("-inf"))  # bug: no scale
        return self.o_proj(merge(s.softmax(-1) @ v))


CORRECT["QKNorm"] = {"causal": True}
PLANTED_2["UnscaledQKNorm"] = ("attention", {"causal": True})


# ---- planted bugs, more of the second generation (invented here)


class SoftmaxQueryAxisBidirectional(HandSoftmax):
    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        return merge(s.softmax(dim=-2).nan_to_num(0.0) @ v)  # bug: normalised over the queries


class DiagonalMasked(HandSoftmax):
    """Causal mask from triu(0): no token sees itself; the first row is empty and zeroed."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        s = self.scores(q, k).masked_fill(torch.ones(T, T, dtype=torch.bool, device=h.device).triu(0), float("-inf"))  # bug
        return merge(s.softmax(dim=-1).nan_to_num(0.0) @ v)


class ScaledByDModel(HandSoftmax):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1] * self.n)  # bug: 1/sqrt(d_model), not 1/sqrt(d_head)


class ScaledTwice(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        q = q / math.sqrt(q.shape[-1])  # bug: SDPA scales by 1/sqrt(d_head) again
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class ResidualTwice(Good):
    def forward(self, x, pad_mask=None):
        x = x + x + self.sa(self.ln1(x), pad_mask)  # bug: the identity counted twice
        return x + self.ffn(self.ln2(x))


class ResidualFromNorm(Good):
    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = h + self.sa(h, pad_mask)  # bug: the residual adds LN(x), not x
        return x + self.ffn(self.ln2(x))


PLANTED_2.update({
    "SoftmaxQueryAxisBidirectional": ("attention", {}),
    "DiagonalMasked": ("attention", {"causal": True}),
    "ScaledByDModel": ("attention", {}),
    "ScaledTwice": ("attention", {}),
    "ResidualTwice": ("residual", {}),
    "ResidualFromNorm": ("residual", {}),
})


class NoNormBeforeFFN(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(x)  # bug: ln2 defined, never applied


class NoNormBeforeAttention(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(x, pad_mask)  # bug: ln1 skipped
        return x + self.ffn(self.ln2(x))


class PostThenPre(Good):
    """Post-LN around attention, Pre-LN around the FFN: the two placements mixed in one block."""

    def forward(self, x, pad_mask=None):
        x = self.ln1(x + self.sa(x, pad_mask))
        return x + self.ffn(self.ln2(x))


PLANTED_2.update({"NoNormBeforeFFN": ("norm_placement", {}), "NoNormBeforeAttention": ("norm_placement", {}),
                  "PostThenPre": ("norm_placement", {})})


class NormOnQueriesOnly(Good):
    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = x + self.attn(h, x, x, key_padding_mask=pad_mask, attn_mask=self.mask(x.shape[1], x.device), need_weights=False)[0]  # bug
        return x + self.ffn(self.ln2(x))


class UpcastsOutput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) * torch.ones(1, dtype=torch.float64)  # bug: the output becomes float64


PLANTED_2.update({"NormOnQueriesOnly": ("norm_placement", {}), "UpcastsOutput": ("shape", {})})


class RawParams(nn.Module):
    """Pre-LN written with bare nn.Parameter matrices used as x @ W.T (no nn.Linear anywhere)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.n = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model)) for _ in range(4))
        self.w_in = nn.Parameter(torch.randn(d_ff, d_model) / math.sqrt(d_model))
        self.w_out = nn.Parameter(torch.randn(d_model, d_ff) / math.sqrt(d_ff))

    def forward(self, x, pad_mask=None):
        h = self.norm1(x)
        q, k, v = (heads(h @ w.T, self.n) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, False, pad_mask))
        x = x + merge(y) @ self.wo.T
        return x + F.gelu(self.norm2(x) @ self.w_in.T) @ self.w_out.T


CORRECT["RawParams"] = {}


class ManualSoftmax(HandSoftmax):
    """Correct: softmax written out as exp / sum (with the max subtracted), not torch.softmax."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return merge((e / e.sum(-1, keepdim=True)) @ v)


class NoSoftmax(HandSoftmax):
    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), 0.0)
        return merge(s @ v)  # bug: the scores weight the values with no softmax


CORRECT["ManualSoftmax"] = {}
PLANTED_2["NoSoftmax"] = ("attention", {})


# ----------------------------------------------------------------------------- third generation: bugs real projects shipped
# A Llama-style causal block with its attention written out (so positions, biases and masks can be planted): RoPE in
# the rotate_half layout with angles in float32, masks filled with the dtype's finite minimum, a norm that upcasts.


class UpcastRMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the input dtype (as Llama's); offset=1 gives Gemma's (1 + w) with w = 0 at init.
    Called with a residual it adds first and returns (normed, sum): a fused add."""

    def __init__(self, d, eps=1e-6, offset=0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            return self.normed(x), x
        return self.normed(x)

    def normed(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)


def rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def rope_freqs(pos, dim, angle_dtype=torch.float32, base=10000.0):
    """(B, T) positions -> (B, 1, T, dim / 2) angles, computed in angle_dtype."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    return (pos.to(angle_dtype)[..., None] * inv.to(angle_dtype))[:, None]


def sinusoid(pos, d):
    """(B, T) positions -> (B, T, d) sinusoidal absolute position vectors."""
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    a = pos.float()[..., None] * inv
    return torch.cat((a.sin(), a.cos()), dim=-1)


class Rel3(nn.Module):
    """Correct: Llama-style, RoPE (rotate_half layout, angles in float32), attention written out, finite mask fills,
    SwiGLU FFN with its residual dropout a plain float `p`."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True, n_kv_heads=None, window=None):
        super().__init__()
        self.n, self.nkv, self.hd = n_heads, n_kv_heads or n_heads, d_model // n_heads
        self.causal, self.window, self.p = causal, window, dropout
        self.attn_norm = UpcastRMSNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d_model, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = UpcastRMSNorm(d_model)
        hidden = d_ff or 2 * d_model
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def positions(self, pad_mask, B, T, device):
        return torch.arange(T, device=device).expand(B, T)  # a relative scheme needs no restart after padding

    def cos_sin(self, pos, dtype):
        f = rope_freqs(pos, self.hd)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, t, pos, sign=1.0):
        cos, sin = self.cos_sin(pos, t.dtype)
        return t * cos + sign * rotate_half(t) * sin

    def bias(self, T, device, dtype):
        return None

    def allowed(self, B, T, pad_mask, device):
        a = torch.ones(T, T, dtype=torch.bool, device=device)
        if self.causal:
            a = a.tril()
        if self.window:
            a = a & ~torch.ones_like(a).tril(-self.window)
        a = a[None, None]
        return a if pad_mask is None else a & ~pad_mask[:, None, None, :]

    def fill(self, s, allowed):
        return s.masked_fill(~allowed, torch.finfo(s.dtype).min)

    def softmax(self, s):
        return torch.softmax(s, dim=-1)

    def attend(self, q, k, v, allowed):
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        b = self.bias(q.shape[-2], q.device, q.dtype)
        if b is not None:
            s = s + b
        return self.softmax(self.fill(s, allowed)) @ v

    def values(self, v, pos):
        return v

    def unvalues(self, y, pos):
        return y

    def attention(self, h, pad_mask):
        B, T, _ = h.shape
        q, k, v = heads(self.q_proj(h), self.n), heads(self.k_proj(h), self.nkv), heads(self.v_proj(h), self.nkv)
        pos = self.positions(pad_mask, B, T, h.device)
        q, k, v = self.rotate(q, pos), self.rotate(k, pos), self.values(v, pos)
        if self.nkv != self.n:
            k, v = k.repeat_interleave(self.n // self.nkv, dim=1), v.repeat_interleave(self.n // self.nkv, dim=1)
        y = self.unvalues(self.attend(q, k, v, self.allowed(B, T, pad_mask, h.device)), pos)
        return self.o_proj(merge(y))

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


def GQA3(d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
    """Correct: grouped-query attention, two query heads per key/value head."""
    return Rel3(d_model, n_heads, d_ff, dropout, causal, n_kv_heads=max(1, n_heads // 2))


def Window3(d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
    """Correct: sliding-window attention (each token sees itself and the 3 before it)."""
    return Rel3(d_model, n_heads, d_ff, dropout, causal, window=4)


def alibi_slopes(n):
    """The ALiBi paper's slopes: geometric from 2^(-8/n), for n a power of two (interleaved otherwise)."""
    p = 2 ** math.floor(math.log2(n))
    first = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    return first + alibi_slopes(2 * p)[0::2][: n - p] if p < n else first


class Alibi3(Rel3):
    """Correct: ALiBi (no rotation; a per-head bias -m_h |i - j| added to the scaled scores)."""

    def slopes(self):
        return torch.tensor(alibi_slopes(self.n))

    def rotate(self, t, pos, sign=1.0):
        return t

    def bias(self, T, device, dtype):
        i = torch.arange(T, device=device)
        dist = (i[:, None] - i[None, :]).abs().float()
        return (-self.slopes().to(device)[:, None, None] * dist).to(dtype)[None]  # (1, nh, T, T)


class AbsPos3(Rel3):
    """Correct: sinusoidal absolute positions added inside the block, counted from each sample's first real token."""

    def rotate(self, t, pos, sign=1.0):
        return t

    def positions(self, pad_mask, B, T, device):
        if pad_mask is None:
            return torch.arange(T, device=device).expand(B, T)
        return ((~pad_mask).long().cumsum(-1) - 1).clamp(min=0)

    def forward(self, x, pad_mask=None):
        pos = self.positions(pad_mask, x.shape[0], x.shape[1], x.device)
        x = x + self.attention(self.attn_norm(x) + sinusoid(pos, x.shape[-1]).to(x.dtype), pad_mask)
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


class Mask3D3(Rel3):
    """Correct: the padding mask turned into one (B, T, T) additive mask before the heads see it."""

    def attention(self, h, pad_mask):
        self._mask3d = None
        B, T, _ = h.shape
        keep = self.allowed(B, T, pad_mask, h.device)[:, 0].expand(B, T, T)  # (B, T, T)
        self._mask3d = torch.zeros(B, T, T, dtype=h.dtype, device=h.device).masked_fill(~keep, torch.finfo(h.dtype).min)
        return super().attention(h, pad_mask)

    def fill(self, s, allowed):
        return s + self._mask3d[:, None]


class Fp16Llama3(Rel3):
    """Correct: written for fp16: softmax in float32, mask fills at the dtype's minimum, the norm upcasts."""

    def softmax(self, s):
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)


class Gemma3(Rel3):
    """Correct: Gemma-style (1 + w) norms with w = 0 at init, the second one fused with the residual add."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.attn_norm = UpcastRMSNorm(d_model, offset=1.0)
        self.ffn_norm = UpcastRMSNorm(d_model, offset=1.0)

    def forward(self, x, pad_mask=None):
        a = self.attention(self.attn_norm(x), pad_mask)
        h, x = self.ffn_norm(a, x)
        return x + F.dropout(self.ffn(h), self.p, self.training)


class RoPEValues3(Rel3):
    """Correct: values rotated at their positions and the weighted sum rotated back at the query's."""

    def values(self, v, pos):
        return self.rotate(v, pos)

    def unvalues(self, y, pos):
        return self.rotate(y, pos, sign=-1.0)


# Correct blocks in the ten styles of issue 20 (CachedRoPE: RoPE with a KV cache; Rel3 in bfloat16: RoPE in bf16).
POS = {"positional": True}
CORRECT_3 = {"Rel3": POS, "CachedRoPE": {"causal": True}, "GQA3": POS, "Window3": POS, "Alibi3": POS, "AbsPos3": POS,
             "Mask3D3": POS, "Fp16Llama3": POS, "Gemma3": POS, "RoPEValues3": POS, "FirstCallInit": {},
             "SublayerPostNorm": {"causal": True}}


class RoPELayoutMismatch(Rel3):
    def cos_sin(self, pos, dtype):
        emb = rope_freqs(pos, self.hd).repeat_interleave(2, dim=-1)  # bug: interleaved-pair angles, half-split rotation
        return emb.cos().to(dtype), emb.sin().to(dtype)


class ValuesNotRotatedBack(RoPEValues3):
    def unvalues(self, y, pos):
        return y  # bug: values rotated, the weighted sum never rotated back


class AbsPosNoRestart(AbsPos3):
    def positions(self, pad_mask, B, T, device):
        return torch.arange(T, device=device).expand(B, T)  # bug: left padding shifts every real token's position


class RoPEAnglesHalf(Rel3):
    def cos_sin(self, pos, dtype):
        f = rope_freqs(pos, self.hd, angle_dtype=dtype)  # bug: positions x frequencies in the run dtype (bf16: 8 bits)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()


class LeftPadNaN(Rel3):
    def fill(self, s, allowed):
        return s.masked_fill(~allowed, float("-inf"))  # bug: a fully masked row (a left pad under causal) gives NaN


class HalfRMSNorm(UpcastRMSNorm):
    def normed(self, x):
        v = x.pow(2).mean(-1, keepdim=True).float()  # bug: squared before the upcast: fp16 overflows above |x| ~ 256
        return (x.float() * torch.rsqrt(v + self.eps) * (self.offset + self.weight.float())).to(x.dtype)


class NormSquaresInHalf(Rel3):
    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.attn_norm, self.ffn_norm = HalfRMSNorm(d_model), HalfRMSNorm(d_model)


class OffsetNormInitOne(Gemma3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        for norm in (self.attn_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)  # bug: (1 + w) with w = 1: every norm doubles its output


class AlibiWrongSlopes(Alibi3):
    def slopes(self):
        return torch.arange(1, self.n + 1, dtype=torch.float32) / self.n  # bug: linear slopes, not the geometric set


class AlibiSlopesReversed(Alibi3):
    def slopes(self):
        return super().slopes().flip(0)  # bug: the paper's slopes, last head first (a checkpoint's heads mismatch)


class ActOnUp(Rel3):
    def ffn(self, h):
        return self.down_proj(self.gate_proj(h) * F.silu(self.up_proj(h)))  # bug: the activation on up_proj


class ActAfterProduct(Rel3):
    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h) * self.up_proj(h)))  # bug: act(gate * up), not act(gate) * up


class SDPADropoutInEval(Rel3):
    """Its attention dropout defaults to 0 and the constructor does not take it: dropout=0.1 is never injected."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=True):
        super().__init__(d_model, n_heads, d_ff, 0.0, causal)
        self.attn_dropout = 0.0

    def attend(self, q, k, v, allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.attn_dropout)  # bug: in eval too


class EvalReturnsEarly(Rel3):
    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        if not self.training:
            return x  # bug: eval skips the FFN
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


class ClosureCapture(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        norm = self.ffn_norm
        self.prenorm = lambda t: norm(t)  # bug: a closure over the submodule: a deepcopy still calls the original

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + F.dropout(self.ffn(self.prenorm(x)), self.p, self.training)


class TrainStateHistory(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("k_cache", None, persistent=False)

    def attention(self, h, pad_mask):
        if self.training:
            self.k_cache = self.k_proj(h)  # bug: a cache written in a training forward keeps the graph alive
        return super().attention(h, pad_mask)


class TrainRunningStat(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("running", torch.ones(()))

    def forward(self, x, pad_mask=None):
        if self.training:
            self.running = 0.9 * self.running + 0.1 * x.pow(2).mean()  # bug: a running statistic updated with grad on
        return super().forward(x / self.running.sqrt(), pad_mask)


class FirstCallInit(Good):
    """Correct: a data-dependent init in the first forward (ActNorm written output-first): the first output ever is not
    what the block computes afterwards, so no check may take its first forward for a later one."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x, pad_mask=None):
        y = super().forward(x, pad_mask) * self.gain
        if not bool(self.ready):
            with torch.no_grad():
                self.gain.copy_(1.0 / y.std())
                self.ready.fill_(True)
        return y


class CrossToLatents(Good):
    """Correct: a second attention, from the tokens to 5 learned latent vectors (scores of 10 x 5: not square)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.latents = nn.Parameter(torch.randn(1, 5, d_model))
        self.lnx = nn.LayerNorm(d_model)
        self.xattn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        m = self.latents.expand(x.shape[0], -1, -1)
        x = x + self.xattn(self.lnx(x), m, m, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


class SublayerPostNorm(LlamaBlock):
    """Correct: OLMo-2's placement, each sublayer reading the stream as it is and its output normalised before the
    residual add (x = x + norm(attn(x)); x = x + norm(ffn(x)))."""

    def forward(self, x, pad_mask=None):
        x = x + self.attn_norm(self.attention(x, pad_mask))
        return x + self.ffn_norm(self.down(F.silu(self.gate(x)) * self.up(x)))


class SublayerPostNormMixed(LlamaBlock):
    """OLMo-2's placement for the attention, Pre-LN for the FFN: two placements in one block."""

    def forward(self, x, pad_mask=None):
        x = x + self.attn_norm(self.attention(x, pad_mask))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # bug: the FFN reads a normalised stream, the attention does not


class StepDependentInplace(Good):
    """From the second training step on, an in-place op on a tensor autograd saved: that step's backward raises, though
    its graph shares nothing with the first step's."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = 0

    def forward(self, x, pad_mask=None):
        y = super().forward(x, pad_mask)
        if self.training and torch.is_grad_enabled():
            self.steps += 1
            if self.steps >= 2:
                s = torch.sigmoid(y)
                return s.mul_(2)  # bug: sigmoid saved its output, modified in place
        return y


# The third generation: name -> (the check that must flag it, its flags; "dtype" names the run dtype it needs).
PLANTED_3 = {
    "RoPELayoutMismatch": ("relative", POS),
    "ValuesNotRotatedBack": ("padding", POS),
    "AbsPosNoRestart": ("padding", POS),
    "RoPEAnglesHalf": ("relative", {"dtype": "bfloat16", **POS}),
    "LeftPadNaN": ("padding", {}),
    "NormSquaresInHalf": ("norms", {"dtype": "float16"}),
    "OffsetNormInitOne": ("norms", {}),
    "AlibiWrongSlopes": ("position_bias", {}),
    "AlibiSlopesReversed": ("position_bias", {}),
    "ActOnUp": ("names", {}),
    "ActAfterProduct": ("names", {}),
    "EvalReturnsEarly": ("train_eval", {}),
    "StepDependentInplace": ("train_state", {}),
    "SublayerPostNormMixed": ("norm_placement", {}),
    "SDPADropoutInEval": ("determinism", {}),
    "ClosureCapture": ("copy", {}),
    "TrainStateHistory": ("train_state", {}),
    "TrainRunningStat": ("train_state", {}),
}



# ----------------------------------------------------------------------------- past one device (check --tp / --fsdp)
# Under tensor parallelism q/k/v and the FFN's first projections are column-sharded: each rank sees a slice
# of their output features. A block is TP-ready when nothing between them and the row-sharded output
# projections needs the full width: heads split as view(B, T, -1, head_dim), not with the global head count.


class LlamaTP(nn.Module):
    """Correct and TP-ready: Llama-style, separate q/k/v/o, SwiGLU, heads split by head_dim (the width each rank has)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.head_dim, self.causal = d_model // n_heads, causal
        hidden = int(8 * d_model / 3) // 32 * 32  # 160 at d_model 64: divisible by the ranks
        self.attn_norm, self.ffn_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def split(self, t):  # (B, T, local width) -> (B, local heads, T, hs)
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    def qk(self, h):
        return self.split(self.q_proj(h)), self.split(self.k_proj(h))

    def attention(self, h, pad_mask):
        q, k = self.qk(h)
        v = self.split(self.v_proj(h))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(h.shape[1], h.device, self.causal, pad_mask))
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + self.ffn(self.ffn_norm(x))


class GlobalHeads(LlamaTP):
    """Correct on one device; under --tp each rank splits its slice into n_heads narrower heads (0.09 off, silently)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.n_heads = n_heads

    def split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, -1).transpose(1, 2)  # bug under TP: the global head count


class FullWidthQKNorm(LlamaTP):
    """OLMo-2-style QK-norm over the full q/k width, written as a functional RMS norm: correct on one device;
    under --tp each rank normalises its own slice of q and k."""

    def qk(self, h):
        q, k = self.q_proj(h), self.k_proj(h)
        q, k = (F.rms_norm(t, t.shape[-1:], eps=1e-6) for t in (q, k))  # bug under TP: the slice's RMS, not q's
        return self.split(q), self.split(k)


class FullWidthQKNormWeighted(LlamaTP):
    """OLMo-2's QK-norm as it is written there: an RMSNorm module of width d_model on q and k. Correct on one
    device; under --tp its d_model weight meets each rank's d_model / N slice."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.q_norm, self.k_norm = RMSNorm(d_model), RMSNorm(d_model)

    def qk(self, h):
        return self.split(self.q_norm(self.q_proj(h))), self.split(self.k_norm(self.k_proj(h)))


class HiddenNormFFN(LlamaTP):
    """NormFormer-style norm over the FFN's hidden units, written functionally: correct on one device; under --tp
    the hidden units are column-sharded and each rank normalises its share."""

    def ffn(self, h):
        a = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return self.down_proj(F.layer_norm(a, a.shape[-1:]))  # bug under TP: the norm needs every hidden unit


class FusedQKV(LlamaTP):
    """Correct, one device and FSDP; --tp refuses it: q, k and v in one Linear (GPT-2's c_attn)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)

    def attention(self, h, pad_mask):
        q, k, v = (self.split(t) for t in self.qkv(h).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(h.shape[1], h.device, self.causal, pad_mask))
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class CapturedWeight(LlamaTP):
    """Correct on one device; under FSDP the up projection's weight, kept in a plain list at construction, is the
    original tensor FSDP replaced: it gets no sharded gradient."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.kept = [self.up_proj.weight]  # bug under FSDP: a reference FSDP does not know about

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * F.linear(h, self.kept[0]))


# Correct on one device (the battery passes), and what --tp 2 / --fsdp 2 must say.
DISTRIBUTED = {
    "LlamaTP": {"tp": "pass", "fsdp": "pass"},
    "GlobalHeads": {"tp": "fail", "fsdp": "pass"},
    "FullWidthQKNorm": {"tp": "fail", "fsdp": "pass"},
    "FullWidthQKNormWeighted": {"tp": "fail", "fsdp": "pass"},
    "HiddenNormFFN": {"tp": "fail", "fsdp": "pass"},
    "FusedQKV": {"tp": "refused", "fsdp": "pass"},
    "CapturedWeight": {"tp": "fail", "fsdp": "fail"},
}
CORRECT.update({"LlamaTP": {"causal": True}, "GlobalHeads": {"causal": True}})  # on one device, both are right
