"""Switches a block's config keeps, contradicted and honoured: Meta's `use_scaled_rope` (Llama 3.1's frequency scaling,
`apply_scaling`), fairseq's `normalize_before` (the norms' placement) and Megatron's `layernorm_zero_centered_gamma`
(a (1 + w) norm weight), and torchtune's Llama3ScaledRoPE attributes (llama-3's scaling kept on the rotary module).
Each planted block fails `spec` naming the entry; each twin passes."""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_numerics import WindowKeptNotApplied
from zoo_training import RMSNorm, Rotary, TrainBlock, heads, merge


def apply_scaling(freqs, scale_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192):
    """Meta's llama3.1 reference: pairs slower than old_context_len / low_freq_factor divided by the factor, faster than
    old_context_len / high_freq_factor kept, a smooth mix in between."""
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mixed = (1 - smooth) * freqs / scale_factor + smooth * freqs
    out = torch.where(wavelen > old_context_len / low_freq_factor, freqs / scale_factor, mixed)
    return torch.where(wavelen < old_context_len / high_freq_factor, freqs, out)


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    rope_theta: float = 500000.0
    use_scaled_rope: bool = True
    norm_eps: float = 1e-6


class ScaledRotary(Rotary):
    def frequencies(self, device=None):
        return apply_scaling(super().frequencies(device))


class ScaledRopeIgnored(TrainBlock):
    """Meta's ModelArgs with use_scaled_rope=True, built as a Llama-3 port whose rotary never calls apply_scaling: the
    long-context checkpoint is read at the unscaled frequencies. Twin: ScaledRopeHonoured."""

    rotary_class = Rotary

    def __init__(self, args: ModelArgs, dropout=0.1, causal=True):
        super().__init__(args.dim, args.n_heads, dropout, causal)
        self.args = args
        self.rotary = self.rotary_class(args.dim // args.n_heads, base=args.rope_theta)


class ScaledRopeHonoured(ScaledRopeIgnored):
    rotary_class = ScaledRotary


class PostNormWhereBeforeSaid(TrainBlock):
    """fairseq's normalize_before=True (each sublayer reads a normalised stream), computed Post-LN: the norm after
    each add. Twin: NormBeforeHonoured."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, normalize_before=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.normalize_before = normalize_before

    def forward(self, x):
        x = self.attn_norm(x + self.drop(self.attention(x)))
        return self.ffn_norm(x + self.ffn(x))


class NormBeforeHonoured(PostNormWhereBeforeSaid):
    def forward(self, x):
        return TrainBlock.forward(self, x)


class OffsetRMSNorm(RMSNorm):
    """Megatron's zero-centred gamma: the weight starts at 0 and the norm scales by (1 + w)."""

    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps)
        nn.init.zeros_(self.weight)

    def reset_parameters(self):
        nn.init.zeros_(self.weight)

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * (1 + self.weight)


class ZeroCenteredIgnored(TrainBlock):
    """Megatron's layernorm_zero_centered_gamma=True, built with plain x * w norms (w starting at 1): a checkpoint
    trained with (1 + w) loads its w near 0 and scales every token by about 0. Twin: ZeroCenteredHonoured."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, layernorm_zero_centered_gamma=True):
        super().__init__(d_model, n_heads, dropout, causal)


class ZeroCenteredHonoured(ZeroCenteredIgnored):
    norm_class = OffsetRMSNorm


class TuneScaledRoPE(Rotary):
    """torchtune's Llama3ScaledRoPE: llama-3's scaling kept as the rotary module's attributes (scale_factor,
    low_freq_factor, high_freq_factor, old_context_len) and applied to its table."""

    applied = True

    def __init__(self, dim, base=500000.0, scale_factor=8, low_freq_factor=1, high_freq_factor=4, old_context_len=8192):
        self.scale_factor, self.low_freq_factor, self.high_freq_factor = scale_factor, low_freq_factor, high_freq_factor
        self.old_context_len = old_context_len
        super().__init__(dim, base)

    def frequencies(self, device=None):
        f = super().frequencies(device)
        if not self.applied:
            return f
        return apply_scaling(f, self.scale_factor, self.low_freq_factor, self.high_freq_factor, self.old_context_len)


class TuneUnscaledRoPE(TuneScaledRoPE):
    """The same attributes, a table left unscaled (a port that dropped apply_scaling)."""

    applied = False


class TuneScalingIgnored(TrainBlock):
    rotary_class = TuneUnscaledRoPE


class TuneScalingHonoured(TrainBlock):
    rotary_class = TuneScaledRoPE


@dataclass
class GptFastArgs:
    """gpt-fast's ModelArgs for Llama 3.1 (litgpt's rope_adjustments is the same dict, `original_max_seq_len` for the
    last key): a rope_scaling dict that names no type, llama-3's by its keys."""

    dim: int = 64
    n_head: int = 4
    rope_base: float = 500000.0
    rope_scaling: dict = field(default_factory=lambda: dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                            original_max_position_embeddings=8192))


class UntypedScalingIgnored(ScaledRopeIgnored):
    """gpt-fast's args, a rotary that never applies its rope_scaling. Twin: UntypedScalingHonoured."""

    def __init__(self, args: GptFastArgs, dropout=0.1, causal=True):
        TrainBlock.__init__(self, args.dim, args.n_head, dropout, causal)
        self.args = args
        self.rotary = self.rotary_class(args.dim // args.n_head, base=args.rope_base)


class UntypedScalingHonoured(UntypedScalingIgnored):
    rotary_class = ScaledRotary


def yarn_frequencies(dim, base, factor, original, beta_fast=32, beta_slow=1):
    """transformers' YaRN table: pairs turning fewer than beta_slow times over the original context divided by the
    factor, more than beta_fast times kept, a ramp linear in the pair index between."""
    plain = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)

    def pair(turns):
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(pair(beta_fast)), 0), min(math.ceil(pair(beta_slow)), dim - 1)
    kept = 1 - ((torch.arange(dim // 2).float() - low) / max(high - low, 1e-3)).clamp(0, 1)
    return plain / factor * (1 - kept) + plain * kept


class YarnRotary(Rotary):
    """transformers' YaRN rotation: its table, and the attention factor 0.1 ln(factor) + 1 on cos and sin (so on q and
    on k: every score times its square)."""

    def __init__(self, dim, base, factor, original, gain=True):
        self.factor, self.original = factor, original
        self.gain = 0.1 * math.log(factor) + 1.0 if gain else 1.0
        super().__init__(dim, base)

    def frequencies(self, device=None):
        return yarn_frequencies(self.dim, self.base, self.factor, self.original).to(device)

    def forward(self, t):
        return super().forward(t) * self.gain


class YarnShortContext(TrainBlock):
    """Correct: YaRN scaling by 4 over an original context of 16 positions: at a head of 8 or 16 channels only the first
    pair is kept, so only the slow pairs' run shows theta's ratio (the first two pairs' ratio is the factor's too).
    Twin: YarnThetaIgnored."""

    base = 10000.0

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=10000.0,
                 rope_scaling=(("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 16))):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rope_theta, self.rope_scaling = rope_theta, dict(rope_scaling)
        self.rotary = YarnRotary(d_model // n_heads, self.base, 4.0, 16)


class YarnThetaIgnored(YarnShortContext):
    """Says rope_theta=10000 and builds its YaRN table on 500000."""

    base = 500000.0


class YarnGainDropped(YarnShortContext):
    """YaRN's table without its attention factor: scores 1/1.14^2 of what the claimed scaling computes (transformers
    multiplies cos and sin by 0.1 ln(4) + 1 unless the dict says otherwise)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rotary = YarnRotary(d_model // n_heads, self.base, 4.0, 16, gain=False)


class YarnGainGiven(YarnGainDropped):
    """The same table and no gain, the dict's own `attention_factor` 1.0 saying so: correct."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rope_scaling = {**self.rope_scaling, "attention_factor": 1.0}


@dataclass
class HybridConfig:
    """transformers 5's Gemma-3 layout in small: every other layer slides over 4 keys, and each kind rotates at its
    own base (rope_parameters keyed by the kind)."""

    layer_types: tuple = ("sliding_attention", "full_attention")
    sliding_window: int = 4
    rope_parameters: dict = field(default_factory=lambda: {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})


class HybridLayer(WindowKeptNotApplied):
    """Layer `layer_idx` of a model with a HybridConfig: slides where `slides` says, rotates at `base`, and keeps the
    window as HF's attention modules do (None on a full-attention layer). The subclasses set what the code does;
    HybridLayer itself is layer 0 done right (sliding, the local base)."""

    layer_idx, slides, base = 0, True, 10000.0
    applied, window = True, 10**9  # the mask reads the kept window, every key where it is None

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, config=None):
        self.config = config or HybridConfig()
        super().__init__(d_model, n_heads, dropout, causal, self.config.sliding_window if self.slides else None)
        self.layer_idx = type(self).layer_idx  # kept on the module, as HF's attention modules keep it
        self.rotary = Rotary(d_model // n_heads, base=self.base)  # its own `base` speaks only where the config is silent


class HybridGlobalLayer(HybridLayer):
    """Layer 1, full attention at the global base, done right."""

    layer_idx, slides, base = 1, False, 1000000.0


class HybridPatternShifted(HybridLayer):
    """Layer 1 (full attention in the config) built with the pattern off by one: it slides, at the local base."""

    layer_idx = 1


class HybridBaseSwapped(HybridLayer):
    """Layer 0 slides as the config says, at the global layers' base."""

    base = 1000000.0


@dataclass
class NoRopeConfig:
    """SmolLM3's layout in small: every fourth layer (index 3, 7, ...) a NoPE layer (`no_rope_layers` 0)."""

    no_rope_layers: tuple = (1, 1, 1, 0)


class NoRopeLayer(TrainBlock):
    """Layer `layer_idx` of a model with a NoRopeConfig, rotating where `rotates` says; this one: layer 3, NoPE, as
    the config says."""

    layer_idx, rotates = 3, False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, config=None):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config, self.layer_idx = config or NoRopeConfig(), type(self).layer_idx

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.rotates:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class NoRopeRotatingLayer(NoRopeLayer):
    """Layer 0, which rotates, as the config says."""

    layer_idx, rotates = 0, True


class NoRopeListInverted(NoRopeLayer):
    """Layer 0 read with the list's meaning inverted (`use_rope = not no_rope_layers[i]`): it does not rotate."""

    layer_idx, rotates = 0, False


PLANTED = {"UntypedScalingIgnored": ("rope.scaling", "rope.factor"), "ScaledRopeIgnored": "rope.scaling", "PostNormWhereBeforeSaid": "norm.placement",
           "ZeroCenteredIgnored": "norm.offset", "TuneScalingIgnored": ("rope.scaling", "rope.factor"),
           "YarnThetaIgnored": "rope.theta", "YarnGainDropped": "attn.scale",
           "HybridPatternShifted": ("attn.window", "rope.theta"), "HybridBaseSwapped": "rope.theta",
           "NoRopeListInverted": "pos.kind"}
CORRECT = ["UntypedScalingHonoured", "ScaledRopeHonoured", "NormBeforeHonoured", "ZeroCenteredHonoured", "TuneScalingHonoured",
           "YarnShortContext", "YarnGainGiven", "HybridLayer", "HybridGlobalLayer", "NoRopeLayer",
           "NoRopeRotatingLayer"]
