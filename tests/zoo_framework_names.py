"""Frameworks' names for what a block is. litgpt's, kept in a `config` dataclass as litgpt's `Block` keeps its `Config`:
`attention_logit_softcapping` (Gemma 2's cap), `attention_scores_scalar` (the X of the score scale 1/sqrt(X)),
`gelu_approximate` ("tanh": the FFN's GELU is the tanh approximation), `n_expert` and `n_expert_per_token` (the
routing), its RMSNorm's `add_unit_offset` (a (1 + w) weight), `norm_class_name` and `mlp_class_name`; Megatron's
`gated_linear_unit` and `normalization`; timm's `mlp_ratio` (an ungated FFN's width over the model's); OLMo's `norm_after` (each sublayer's output normalised before the add) and
`activation_type`; nanoGPT's `LayerNorm` class name beside a bias (T5's bias-free `T5LayerNorm` says nothing). Each
planted block contradicts one and fails `spec`
naming the entry; each twin honours it and passes."""

from dataclasses import dataclass, field, make_dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import MoEBlock, RMSNorm, TrainBlock, attend


@dataclass
class Config:
    n_embd: int = 64
    n_head: int = 4
    attention_logit_softcapping: float | None = None
    attention_scores_scalar: int | None = None
    gelu_approximate: str = "none"
    n_expert: int = 0
    n_expert_per_token: int = 0
    norm_class_name: str | None = None
    mlp_class_name: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class TransformerConfig:
    """Megatron-core's names: `gated_linear_unit`, `normalization`, `kv_channels`, `num_query_groups`."""

    hidden_size: int = 64
    num_attention_heads: int = 4
    gated_linear_unit: bool = True
    normalization: str = "RMSNorm"


class CapSaid(TrainBlock):
    """Gemma 2's cap in the config; the attention never applies it. Twin: CapHonoured."""

    applied = False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, attention_logit_softcapping=30.0)

    def attention(self, h):
        return attend(self, h, cap=self.config.attention_logit_softcapping if self.applied else None)


class CapHonoured(CapSaid):
    applied = True


class ScoresScalarSaid(TrainBlock):
    """Scores scaled by 1/sqrt(attention_scores_scalar) (Gemma's 256 beside a head of 16) in litgpt; this port keeps
    1/sqrt(head width). Twin: ScoresScalarHonoured."""

    applied = False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, attention_scores_scalar=4 * d_model)

    def attention(self, h):
        return attend(self, h, scale=self.config.attention_scores_scalar ** -0.5 if self.applied else None)


class ScoresScalarHonoured(ScoresScalarSaid):
    applied = True


class GeluTanhSaid(TrainBlock):
    """gelu_approximate="tanh" (Gemma, Phi-2) and an FFN with the exact GELU. Twin: GeluTanhHonoured."""

    approximate = "none"

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, gelu_approximate="tanh")
        del self.w3  # litgpt's GptNeoxMLP: fc, gelu, proj

    def ffn(self, h):
        return self.drop(self.w2(F.gelu(self.w1(h), approximate=self.approximate)))


class GeluTanhHonoured(GeluTanhSaid):
    approximate = "tanh"


class ExpertsPerTokenSaid(MoEBlock):
    """n_expert_per_token=2 in the config; the router picks one expert per token. Twin: ExpertsPerTokenHonoured."""

    top_k = 1

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, n_expert=4, n_expert_per_token=2)

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (top * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return self.drop(out)


class ExpertsPerTokenHonoured(ExpertsPerTokenSaid):
    top_k = 2


class UnitOffsetNorm(RMSNorm):
    """litgpt's RMSNorm: `add_unit_offset` True scales by (1 + w), w initialised at 0 as Gemma's checkpoints expect."""

    offset_applied = True

    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps)
        self.add_unit_offset = True
        nn.init.zeros_(self.weight)

    def reset_parameters(self):
        nn.init.zeros_(self.weight)

    def forward(self, x):  # in float32 whatever the run's dtype, as litgpt's
        w = 1 + self.weight if self.offset_applied else self.weight
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()).to(x.dtype)


class PlainWeightNorm(UnitOffsetNorm):
    """Keeps add_unit_offset=True and is a plain norm (w from 1, scaled by w): Gemma's checkpoints, whose w is the
    offset from 1, then scale by w - 1."""

    offset_applied = False

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def __init__(self, d, eps=1e-6):
        super().__init__(d, eps)
        self.reset_parameters()


class UnitOffsetSaid(TrainBlock):
    """Its norms say add_unit_offset and scale by w. Twin: UnitOffsetHonoured."""

    norm_class = PlainWeightNorm


class UnitOffsetHonoured(TrainBlock):
    norm_class = UnitOffsetNorm


class PlainMLPSaidGated(TrainBlock):
    """litgpt's Config says LLaMAMLP (gated) and RMSNorm; the port builds a plain GELU MLP beside torch's LayerNorm.
    Twin: LlamaMLPAsSaid."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")
        self.attn_norm, self.ffn_norm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        del self.w3

    def ffn(self, h):
        return self.drop(self.w2(F.gelu(self.w1(h))))


class LlamaMLPAsSaid(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = Config(d_model, n_heads, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")


class UngatedWhereMegatronGates(PlainMLPSaidGated):
    """Megatron's TransformerConfig with gated_linear_unit=True, its normalization LayerNorm, and an ungated FFN.
    Twin: MegatronGatedAsSaid."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.config
        self.config = TransformerConfig(d_model, n_heads, normalization="LayerNorm")


class MegatronGatedAsSaid(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = TransformerConfig(d_model, n_heads)


# OLMo's names: `norm_after` (OLMo 2's placement when True) and `activation_type`
ModelConfig = make_dataclass("ModelConfig", [("d_model", int, 64), ("n_heads", int, 4), ("norm_after", bool, True),
                                             ("activation_type", str, "swiglu")])


class NormAfterSaidPreComputed(TrainBlock):
    """OLMo's ModelConfig with norm_after=True (OLMo 2); the port normalises each sublayer's input. Twin: NormAfterAsSaid."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = ModelConfig(d_model, n_heads)


class NormAfterAsSaid(NormAfterSaidPreComputed):
    def forward(self, x):
        x = x + self.drop(self.attn_norm(self.attention(x)))
        return x + self.ffn_norm(self.ffn(x))


class MlpRatioIgnored(TrainBlock):
    """timm's argument mlp_ratio=4.0 (the FFN 4 x d_model wide) and an FFN built 2 x d_model wide. Twin:
    MlpRatioHonoured; a gated FFN's ratio is not judged (MlpRatioGated: Meta's 2/3 of it)."""

    ratio_used = 2

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, mlp_ratio=4.0):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3
        self.w1, self.w2 = nn.Linear(d_model, self.ratio_used * d_model), nn.Linear(self.ratio_used * d_model, d_model)

    def ffn(self, h):
        return self.drop(self.w2(F.gelu(self.w1(h))))


class MlpRatioHonoured(MlpRatioIgnored):
    ratio_used = 4


class MlpRatioGated(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, mlp_ratio=4.0):
        super().__init__(d_model, n_heads, dropout, causal)  # SwiGLU 8/3 x d_model wide


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm, an optional bias beside the weight: a LayerNorm, as its name says."""

    def __init__(self, d, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class UncentredLayerNorm(LayerNorm):
    """A LayerNorm that never subtracts the mean: an RMSNorm with a bias, under LayerNorm's name."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


UncentredLayerNorm.__name__ = UncentredLayerNorm.__qualname__ = "LayerNorm"


class T5LayerNorm(RMSNorm):
    """T5's norm: an RMSNorm without a bias under a LayerNorm name, by design."""


class LayerNormUncentred(TrainBlock):
    norm_class = UncentredLayerNorm


class LayerNormOwn(TrainBlock):
    norm_class = LayerNorm


class T5NamedRMSNorm(TrainBlock):
    """T5LayerNorm is an RMSNorm by design and keeps no bias: its name claims nothing, whatever it computes."""

    norm_class = T5LayerNorm

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=10000.0):
        super().__init__(d_model, n_heads, dropout, causal)


PLANTED = {"MlpRatioIgnored": "ffn.hidden", "NormAfterSaidPreComputed": "norm.placement", "PlainMLPSaidGated": ("ffn.gated", "norm.kind"), "UngatedWhereMegatronGates": "ffn.gated",
           "CapSaid": "attn.softcap", "ScoresScalarSaid": "attn.scale", "GeluTanhSaid": "ffn.act",
           "ExpertsPerTokenSaid": "moe.top_k", "UnitOffsetSaid": "norm.offset",
           "LayerNormUncentred": "norm.kind"}
CORRECT = ["MlpRatioHonoured", "MlpRatioGated", "NormAfterAsSaid", "LlamaMLPAsSaid", "MegatronGatedAsSaid", "CapHonoured", "ScoresScalarHonoured", "GeluTanhHonoured", "ExpertsPerTokenHonoured", "UnitOffsetHonoured",
           "LayerNormOwn", "T5NamedRMSNorm"]
