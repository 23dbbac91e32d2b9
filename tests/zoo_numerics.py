"""Numerics and construction that only training shows: a softmax that overflows once logits grow, NaN gradients from
rows that see no key, norm gains drawn at random by an init loop, attention saturated as built, two Parameters on
one storage, a norm module registered twice, a checkpointing path that drops the padding mask, a window or scale the
block keeps but does not apply, an auxiliary loss kept detached, a gain reset at every forward, an RMSNorm without its
square root, an activation on the residual stream. Each planted bug has a correct twin; and designs that looked like bugs to earlier
versions (nGPT's unit-sphere stream, Primer's convolutions on q/k/v, a binding clip_qkv). Each is `TrainBlock` of
tests/zoo_training.py with one thing changed; constructors take tblock's keywords."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from zoo_construction import HeadsBuilt, HeadsListMultiplied  # noqa: F401
from zoo_training import RMSNorm, TrainBlock, heads, merge


class PaddedBlock(TrainBlock):
    """TrainBlock taking a padding mask (True = pad), its own scores: causal, the mask filled with `fill`, a row
    that sees no key handled by `softmax`; `additive` adds the mask to the scores (a float mask of 0 and `fill`, as
    many models build it) instead of masked_fill, whose backward zeroes the masked positions' gradients."""

    fill = float("-inf")
    additive = False

    def scores(self, q, k):
        return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])

    def softmax(self, s):
        return s.softmax(-1)

    def attention(self, h, pad_mask=None):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        T = h.shape[1]
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        if pad_mask is not None:
            allowed = allowed & ~pad_mask[:, None, None, :]
        s = self.scores(q, k)
        if self.additive:
            s = s + torch.zeros(allowed.shape, dtype=s.dtype, device=s.device).masked_fill(~allowed, self.fill)
        else:
            s = s.masked_fill(~allowed, self.fill)
        w = self.softmax(s)
        return self.o_proj(merge(F.dropout(w, self.p, self.training) @ v))

    def forward(self, x, pad_mask=None):
        x = x + self.drop(self.attention(self.attn_norm(x), pad_mask))
        return x + self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------- planted


class NaNHiddenByNanToNum(PaddedBlock):
    """An additive -inf mask, then nan_to_num after the softmax: a left-padded row that sees no key is NaN, zeroed in
    the forward, but its backward is 0 * NaN: NaN gradients in the q and k projections."""

    additive = True

    def softmax(self, s):
        return torch.nan_to_num(s.softmax(-1))


class NaiveSoftmax(PaddedBlock):
    """exp(s) / sum(exp(s)): finite at init, inf / inf = NaN once a logit passes 88."""

    def softmax(self, s):
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)


class RandomNormGains(TrainBlock):
    """An init loop over every parameter: the RMSNorm weights drawn from N(0, 0.02) with the projections."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        for p in self.parameters():
            nn.init.normal_(p, 0.0, 0.02)


class SaturatedInit(TrainBlock):
    """q and k projections drawn with std 1 (an embedding's init): each query's softmax sits on one key."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        nn.init.normal_(self.q_proj.weight, 0.0, 1.0)
        nn.init.normal_(self.k_proj.weight, 0.0, 1.0)


class AliasedViaData(TrainBlock):
    """Shared-QK meant, written as `k_proj.weight.data = q_proj.weight.data`: two Parameters on one storage, each
    with its own gradient and optimizer state, so every step moves the weight twice."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.k_proj.weight.data = self.q_proj.weight.data


class SharedNorm(TrainBlock):
    """`self.ffn_norm = self.attn_norm`: one set of gains for both sublayers."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.ffn_norm = self.attn_norm


class CheckpointDropsMask(PaddedBlock):
    """Its own `gradient_checkpointing` switch runs attention through checkpoint() without the padding mask."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gradient_checkpointing = False
        self.fill = torch.finfo(torch.float32).min

    def passes_mask(self, h, pad_mask):
        return checkpoint(self.attention, h, use_reentrant=False)

    def forward(self, x, pad_mask=None):
        h = self.attn_norm(x)
        a = self.passes_mask(h, pad_mask) if self.gradient_checkpointing and self.training else self.attention(h, pad_mask)
        x = x + self.drop(a)
        return x + self.ffn(self.ffn_norm(x))


class WindowKeptNotApplied(TrainBlock):
    """Built with sliding_window=4 and keeping it, attending to the whole causal prefix."""

    applied, window = False, None  # window: the width where sliding_window is None (zoo_sizes' WindowWhereNone)

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, sliding_window=4):
        super().__init__(d_model, n_heads, dropout, causal)
        self.sliding_window = sliding_window

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        i = torch.arange(h.shape[1], device=h.device)
        allowed = i[:, None] >= i[None, :]
        if self.applied:
            allowed = allowed & (i[:, None] - i[None, :] < (self.sliding_window or self.window))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class ScalingKeptWrong(TrainBlock):
    """head_dim twice d_model / n_heads (Gemma-7B's shapes), `self.scaling = head_dim ** -0.5` kept, the scores
    scaled by (d_model // n_heads) ** -0.5."""

    right = False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.head_dim = 2 * d_model // n_heads
        self.scaling = self.head_dim ** -0.5
        self.d_model = d_model
        inner = n_heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, inner, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.rotary = self.rotary_class(self.head_dim)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        scale = self.scaling if self.right else (self.d_model // self.n_heads) ** -0.5
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class SwitchAuxDetached(TrainBlock):
    """Top-1 switch routing over 4 experts with a load-balancing loss kept as `self.aux_loss` for the trainer to add,
    computed from detached router probabilities: it never reaches the router."""

    detach = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3  # the experts are the FFN
        self.router = nn.Linear(d_model, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))
                                     for _ in range(4))
        self.aux_loss = None

    def balance(self, probs, idx):
        """Switch Transformer's load-balancing loss: n_experts * sum(fraction routed * mean probability)."""
        frac = F.one_hot(idx, 4).to(probs.dtype).mean((0, 1))
        return 4 * (frac * (probs.detach() if self.detach else probs).mean((0, 1))).sum()

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        top, idx = probs.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                out[sel] = (expert(h[sel]) * top[sel][:, None]).to(out.dtype)
        self.aux_loss = self.balance(probs, idx)
        return self.drop(out)


class GainResetInForward(TrainBlock):
    """The FFN norm's gain written back to ones at every forward (an init done in forward): each step's update is
    undone by the next call, so the gain never trains."""

    def forward(self, x):
        with torch.no_grad():
            self.ffn_norm.weight.fill_(1.0)
        return super().forward(x)


class RMSNormNoSqrt(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight  # bug: no square root


class NormWithoutSqrt(TrainBlock):
    """An RMSNorm class that divides by the mean square, not its root: its output scales as 1 / the input's."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = RMSNormNoSqrt(d_model), RMSNormNoSqrt(d_model)


class RMSNormOverTokens(RMSNormNoSqrt):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + self.eps) * self.weight  # bug: dim 1 (tokens), not -1


class NormOverTokens(TrainBlock):
    """An RMSNorm class whose statistics are taken over the sequence axis: each channel normalised over the tokens, so
    one token's output moves with the others. Bidirectional, without a padding mask: no causal or padding probe sees it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = RMSNormOverTokens(d_model), RMSNormOverTokens(d_model)


class ActOnStream(TrainBlock):
    """A GELU on the residual stream after the FFN's add: the identity path bends (gelu(S x) / S -> relu(x))."""

    def forward(self, x):
        return F.gelu(super().forward(x))


PLANTED = {"NaNHiddenByNanToNum": ("padding", "padding.grad_nonfinite"),
           "NaiveSoftmax": ("attention", "attention.overflows"),
           "RandomNormGains": ("norms", "norms.random_gain"),
           "SaturatedInit": ("attention", "attention.saturated"),
           "AliasedViaData": ("optimizer_step", "optimizer_step.aliased"),
           "HeadsListMultiplied": ("optimizer_step", "optimizer_step.repeated"),
           "SharedNorm": ("norm_placement", "norm_placement.shared"),
           "CheckpointDropsMask": ("checkpointing", "checkpointing.differs"),
           "WindowKeptNotApplied": ("spec", "spec.not_like"),
           "ScalingKeptWrong": ("spec", "spec.not_like"),
           "SwitchAuxDetached": ("grad_params", "grad_params.loss_detached"),
           "GainResetInForward": ("optimizer_step", "optimizer_step.unchanged"),
           "NormWithoutSqrt": ("norms", "norms.not_invariant"),
           "NormOverTokens": ("norms", "norms.across_tokens"),
           "ActOnStream": ("residual", "residual.not_linear")}


# ----------------------------------------------------------------------------- correct twins


class FinfoMinFill(PaddedBlock):
    """An additive mask of finfo.min: a row that sees no key is uniform, finite forward and backward."""

    fill = torch.finfo(torch.float32).min
    additive = True


class StableHandSoftmax(PaddedBlock):
    """A softmax written out with the row maximum subtracted."""

    fill = torch.finfo(torch.float32).min

    def softmax(self, s):
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)


class InitLoopSkipsNorms(TrainBlock):
    """GPT-2's init loop: N(0, 0.02) for the projections only, the norms keep their ones."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)


class NormGainInitValues(TrainBlock):
    """timm's ResPostBlock: the norm after each branch is where LayerScale lives, its weight a constant 1e-5."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.attn_norm, self.ffn_norm  # the norms sit on the branches' outputs
        self.post_attn, self.post_ffn = RMSNorm(d_model), RMSNorm(d_model)
        nn.init.constant_(self.post_attn.weight, 1e-5)
        nn.init.constant_(self.post_ffn.weight, 1e-5)

    def forward(self, x):
        x = x + self.post_attn(self.drop(self.attention(x)))
        return x + self.post_ffn(self.ffn(x))


class TiedAsOneParameter(TrainBlock):
    """Shared-QK as a tie should be: one Parameter under two names."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.k_proj.weight = self.q_proj.weight


class CheckpointKeepsMask(CheckpointDropsMask):
    def passes_mask(self, h, pad_mask):
        return checkpoint(self.attention, h, pad_mask, use_reentrant=False)


class WindowApplied(WindowKeptNotApplied):
    applied = True


class ScalingKeptRight(ScalingKeptWrong):
    right = True


class UnitSphere(TrainBlock):
    """nGPT (Loshchilov et al. 2024): every token on the unit sphere, h <- norm(h + alpha (norm(f(h)) - h)); its
    output's gain against an RMS-1 input is 1/sqrt(d), so tr(J)/n is too."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.attn_norm, self.ffn_norm  # F.normalize is the norm
        self.alpha_attn = nn.Parameter(torch.full((d_model,), 0.05))
        self.alpha_ffn = nn.Parameter(torch.full((d_model,), 0.05))

    def forward(self, x):
        n = lambda t: F.normalize(t, dim=-1, eps=1e-6)  # noqa: E731 - the default eps, 1e-12, is 0 in float16
        h = n(x)
        h = n(h + self.alpha_attn * (n(self.attention(h)) - h))
        return n(h + self.alpha_ffn * (n(self.ffn(h)) - h))


class ConvolvedQKV(TrainBlock):
    """Primer (So et al. 2021): a causal depthwise 3-tap convolution after each of the q/k/v projections, no rotary:
    its zero padding makes the first two positions differ on identical tokens."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.convs = nn.ModuleList(nn.Conv1d(d_model, d_model, 3, groups=d_model, padding=2) for _ in range(3))

    def attention(self, h):
        T = h.shape[1]
        q, k, v = (heads(c(p(h).transpose(1, 2))[..., :T].transpose(1, 2), self.n_heads)
                   for p, c in zip((self.q_proj, self.k_proj, self.v_proj), self.convs))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class SwitchAuxKept(SwitchAuxDetached):
    """The loss kept with its graph (fairseq's and DeepSpeed's MoE layers keep `l_aux` so)."""

    detach = False


class SwitchAuxReturned(SwitchAuxDetached):
    """The live loss returned beside the output, a detached copy kept for logging."""

    def ffn(self, h):
        out = super().ffn(h)
        self.live, self.aux_loss = self.aux_loss, None
        return out

    def balance(self, probs, idx):
        live = 4 * (F.one_hot(idx, 4).to(probs.dtype).mean((0, 1)) * probs.mean((0, 1))).sum()
        self.logged_loss = live.detach()
        return live

    def forward(self, x):
        return super().forward(x), self.live


class DenseAuxPlaceholder(TrainBlock):
    """A dense block sharing its MoE sibling's interface: `self.aux_loss = torch.zeros(())` every forward."""

    def forward(self, x):
        self.aux_loss = torch.zeros(())
        return super().forward(x)


CORRECT = ["FinfoMinFill", "StableHandSoftmax", "InitLoopSkipsNorms", "NormGainInitValues", "TiedAsOneParameter",
           "CheckpointKeepsMask", "WindowApplied", "ScalingKeptRight", "UnitSphere", "ConvolvedQKV", "SwitchAuxKept", "SwitchAuxReturned", "DenseAuxPlaceholder",
           "HeadsBuilt"]
