"""Blocks that say one thing of themselves and compute another, for the `spec` check without a declaration: a
rotary base taken as an argument that never reaches the frequencies, a soft-cap kept and never applied, an attention
module whose `scale` is 1/sqrt(d_head) while it divides by sqrt(d_model), a config's `hidden_act` that is not the
activation used, norms that keep an eps they do not use, a partial rotation taken and not applied; and the correct
twins, each honouring what it says. Built on TrainBlock of tests/zoo_training.py."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import RMSNorm, Rotary, TrainBlock, attend

# ----------------------------------------------------------------------------- says one thing, computes another


class RotaryBaseIgnored(TrainBlock):
    """rope_theta is an argument, but the rotary table is built with 10000."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=500000.0):
        super().__init__(d_model, n_heads, dropout, causal)  # Rotary(d_head) at its default base 10000


class SoftcapIgnored(TrainBlock):
    """A logit soft-cap kept on the block and never applied."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, softcap=20.0):
        super().__init__(d_model, n_heads, dropout, causal)
        self.softcap = softcap

    def attention(self, h):
        return attend(self, h)


class SelfAttention(nn.Module):
    """Causal attention keeping its score scale as `scale`; divides by sqrt(d_model) where `wrong`."""

    def __init__(self, d_model, n_heads, wrong):
        super().__init__()
        self.n_heads, self.wrong = n_heads, wrong
        self.scale = (d_model // n_heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.rotary, self.p = Rotary(d_model // n_heads), 0.0

    def forward(self, h):
        return attend(self, h, scale=1 / math.sqrt(h.shape[-1]) if self.wrong else self.scale)


class ScaleAttributeContradicted(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.rotary  # the attention module has its own
        self.attn = SelfAttention(d_model, n_heads, wrong=True)

    def attention(self, h):
        return self.attn(h)


@dataclass
class FFNConfig:
    d_model: int = 64
    n_heads: int = 4
    hidden_act: str = "gelu"


class ActivationContradicted(TrainBlock):
    """A config whose hidden_act is gelu; the FFN computes silu (SwiGLU)."""

    def __init__(self, config: FFNConfig):
        super().__init__(config.d_model, config.n_heads, 0.1, True)
        self.config = config


class FixedEpsNorm(RMSNorm):
    """Keeps the eps it was given, and divides with 1e-6 whatever it was."""

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class NormEpsIgnored(TrainBlock):
    """Norms built with eps 1e-5 that compute with 1e-6."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = FixedEpsNorm(d_model, eps=1e-5), FixedEpsNorm(d_model, eps=1e-5)


class PartialRotationIgnored(TrainBlock):
    """partial_rotary_factor=0.5 taken, and every channel of the head rotated."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, partial_rotary_factor=0.5):
        super().__init__(d_model, n_heads, dropout, causal)


# ----------------------------------------------------------------------------- correct twins


class RotaryBaseHonoured(RotaryBaseIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=500000.0):
        super().__init__(d_model, n_heads, dropout, causal, rope_theta)
        self.rotary = Rotary(d_model // n_heads, base=rope_theta)


class SoftcapApplied(SoftcapIgnored):
    def attention(self, h):
        return attend(self, h, cap=self.softcap)


class ScaleAttributeHonoured(ScaleAttributeContradicted):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn = SelfAttention(d_model, n_heads, wrong=False)


class HalfRotary(nn.Module):
    """Rotates the first `rotary_dims` channels of each head and passes the rest through."""

    def __init__(self, rotary_dims):
        super().__init__()
        self.rotary_dims, self.inner = rotary_dims, Rotary(rotary_dims)

    def forward(self, t):
        r = self.rotary_dims
        return torch.cat((self.inner(t[..., :r]), t[..., r:]), -1)


class PartialRotationHonoured(PartialRotationIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, partial_rotary_factor=0.5):
        super().__init__(d_model, n_heads, dropout, causal, partial_rotary_factor)
        self.rotary = HalfRotary(int(partial_rotary_factor * (d_model // n_heads)))


class ActivationHonoured(ActivationContradicted):
    def ffn(self, h):
        return self.drop(self.w2(F.gelu(self.w1(h)) * self.w3(h)))


PLANTED = {"RotaryBaseIgnored": "rope.theta", "SoftcapIgnored": "attn.softcap",
           "ScaleAttributeContradicted": "attn.scale", "ActivationContradicted": "ffn.act", "NormEpsIgnored": "norm.eps",
           "PartialRotationIgnored": "rope.dims"}
CORRECT = ["RotaryBaseHonoured", "SoftcapApplied", "ScaleAttributeHonoured", "ActivationHonoured", "PartialRotationHonoured"]
