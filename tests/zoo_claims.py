"""Blocks that say one thing of themselves and compute another, for the `spec` check without a declaration: a
rotary base taken as an argument that never reaches the frequencies, a soft-cap kept and never applied, an attention
module whose `scale` is 1/sqrt(d_head) while it divides by sqrt(d_model), a config's `hidden_act` that is not the
activation used, norms that keep an eps they do not use, a partial rotation taken and not applied, a rotary scaling
asked for and not applied, a parallel residual asked for and the sequential one computed, an RMSNorm that subtracts
the mean, a rotary module that runs and never reaches the scores (its output dropped; q rotated, k not), an interleave
switch the rotary pairing contradicts, a
`causal=True` or a `CausalSelfAttention` that masks nothing (the `causal` check's, run without --causal); and the
correct twins, each honouring what it says (one permutes q's channels before a rotate-half, as HF's DeepSeek-V3). Built on TrainBlock of tests/zoo_training.py."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import RMSNorm, Rotary, TrainBlock, attend, heads, merge

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


class RopeScalingIgnored(TrainBlock):
    """A linear rotary scaling (factor 4) taken as an argument, and the plain table used."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_scaling=None):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rope_scaling = rope_scaling or {"rope_type": "linear", "factor": 4.0}


class ParallelResidualIgnored(TrainBlock):
    """parallel_residual=True taken, and the FFN reads attention's output (the sequential form)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, parallel_residual=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.parallel_residual = parallel_residual


class CentredRMSNorm(RMSNorm):
    """Named RMSNorm, and it subtracts the mean first: a LayerNorm without its bias."""

    def forward(self, x):
        return super().forward(x - x.mean(-1, keepdim=True))


class RMSNormCentred(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = CentredRMSNorm(d_model), CentredRMSNorm(d_model)


class RotaryDropped(TrainBlock):
    """The rotary module runs on q and k, and its outputs are dropped: no position reaches the scores."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        self.rotary(q), self.rotary(k)
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))


class RotaryOnQueries(TrainBlock):
    """Only q rotated: each score depends on the query's own position, not on the distance to the key."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(merge(F.scaled_dot_product_attention(self.rotary(q), k, v, is_causal=self.causal)))


class MaskForgotten(TrainBlock):
    """Built with causal=True, and the attention attends to every key."""

    def attention(self, h):
        T = h.shape[1]
        return attend(self, h, mask=torch.ones(T, T, dtype=torch.bool, device=h.device))


class CausalSelfAttention(nn.Module):
    """Self-attention named causal, with a switch for the mask (nanoGPT's class name)."""

    def __init__(self, d_model, n_heads, masked):
        super().__init__()
        self.n_heads, self.masked = n_heads, masked
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        q, k, v = (heads(t, self.n_heads) for t in self.qkv(x).chunk(3, -1))
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.masked)))


class NamedBlock(nn.Module):
    """A Pre-LN block around CausalSelfAttention, with no causal switch of its own: only the class name says it."""

    def __init__(self, d_model=64, n_heads=4, masked=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, masked)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


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


class LinearScaledRotary(Rotary):
    def __init__(self, dim, factor):
        self.factor = factor
        super().__init__(dim)

    def frequencies(self, device=None):
        return super().frequencies(device) / self.factor


class RopeScalingHonoured(RopeScalingIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_scaling=None):
        super().__init__(d_model, n_heads, dropout, causal, rope_scaling)
        self.rotary = LinearScaledRotary(d_model // n_heads, self.rope_scaling["factor"])


class ParallelResidualHonoured(ParallelResidualIgnored):
    def forward(self, x):
        return x + self.drop(self.attention(self.attn_norm(x))) + self.ffn(self.ffn_norm(x))


class LayerNormStreamRMSHeads(TrainBlock):
    """The stream normalised by F.layer_norm, q and k by RMSNorm modules: every norm module says RMSNorm, and the
    stream's norms (what the card reads) are LayerNorms, correctly."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.attn_norm, self.ffn_norm
        self.q_norm, self.k_norm = RMSNorm(d_model // n_heads), RMSNorm(d_model // n_heads)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(self.q_norm(q)), self.rotary(self.k_norm(k))
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))

    def forward(self, x):
        x = x + self.drop(self.attention(F.layer_norm(x, x.shape[-1:])))
        return x + self.ffn(F.layer_norm(x, x.shape[-1:]))


class ZeroQueryInit(TrainBlock):
    """muP's initialisation: the query projection starts at zero, so q shows no rotation; k's is read instead."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        nn.init.zeros_(self.q_proj.weight)


class RotaryKeptUnused(RotaryBaseHonoured):
    """A layer without positions (NoPE) that keeps its rotary module and rope_theta and never calls it."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))


class NamedBlockMasked(NamedBlock):
    def __init__(self, d_model=64, n_heads=4, masked=True):
        super().__init__(d_model, n_heads, masked)


class GroupedQuery(TrainBlock):
    """Grouped-query attention asked for with num_key_value_heads: k/v projections of that many heads, each shared by
    num_heads / num_key_value_heads query heads (repeat_interleave)."""

    def __init__(self, d_model=64, n_heads=4, num_key_value_heads=2, expand=True):
        super().__init__(d_model, n_heads, 0.0, True)
        self.num_heads, self.num_key_value_heads, self.expand = n_heads, num_key_value_heads, expand
        kv = (num_key_value_heads if expand else n_heads) * (d_model // n_heads)
        self.k_proj, self.v_proj = nn.Linear(d_model, kv, bias=False), nn.Linear(d_model, kv, bias=False)

    def attention(self, h):
        B, T, _ = h.shape
        q = heads(self.q_proj(h), self.n_heads)
        k, v = (p(h).view(B, T, -1, q.shape[-1]).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        k, v = self.tiled(k, v, self.n_heads // k.shape[1])
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))

    def tiled(self, k, v, group):
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


class KVHeadsIgnored(GroupedQuery):
    """num_key_value_heads taken and kept, and a full multi-head attention built (the count never reached the
    projections): a checkpoint of the grouped layer does not load, and it trains another architecture."""

    def __init__(self, d_model=64, n_heads=4, num_key_value_heads=2):
        super().__init__(d_model, n_heads, num_key_value_heads, expand=False)


class DifferentialHeads(TrainBlock):
    """Differential attention (Ye et al. 2024): each of num_heads heads is two q.k products of half the width, their
    softmaxes subtracted (lambda 0.8) before the values; num_kv_heads grouped the same way. Both counts double in the
    product and the group stays num_heads / num_kv_heads."""

    def __init__(self, d_model=64, n_heads=4, num_kv_heads=2):
        super().__init__(d_model, n_heads, 0.0, True)
        self.num_heads, self.num_kv_heads, self.hd = n_heads, num_kv_heads, d_model // n_heads // 2
        self.k_proj = nn.Linear(d_model, 2 * num_kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d_model, 2 * num_kv_heads * self.hd, bias=False)

    def attention(self, h):
        B, T, _ = h.shape
        H, kv, hd = self.num_heads, self.num_kv_heads, self.hd
        q = self.q_proj(h).view(B, T, 2 * H, hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, 2 * kv, hd).transpose(1, 2).repeat_interleave(H // kv, 1)
        v = self.v_proj(h).view(B, T, kv, 2 * hd).transpose(1, 2).repeat_interleave(H // kv, 1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        w = scores.softmax(-1).view(B, H, 2, T, T)
        return self.o_proj(merge((w[:, :, 0] - 0.8 * w[:, :, 1]) @ v))


class HalfSplitRotary(Rotary):
    """RoPE pairing channel i with i + dims/2 (GPT-NeoX's and Hugging Face's layout), where Rotary pairs 2i, 2i + 1."""

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t.chunk(2, dim=-1)
        return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)


class PairingContradicted(TrainBlock):
    """`rope_interleaved=False` (half-split pairs, as checkpoints in Hugging Face's layout expect), rotating
    interleaved pairs: a converted checkpoint's q and k come out scrambled."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_interleaved=False):
        super().__init__(d_model, n_heads, dropout, causal)


class PairingHonoured(PairingContradicted):
    rotary_class = HalfSplitRotary


class InterleavedSaid(TrainBlock):
    """`rope_interleaved=True` over the interleaved Rotary (Meta's layout)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_interleaved=True):
        super().__init__(d_model, n_heads, dropout, causal)


class DeinterleavedRotary(HalfSplitRotary):
    """Hugging Face's DeepSeek-V3 with rope_interleave: the channels put in half-split order (2i to i, 2i + 1 to
    i + dims/2), then rotated half-split: the pairs are (2i, 2i + 1) in the projection's channels, as the switch says."""

    def forward(self, t):
        *lead, d = t.shape
        return super().forward(t.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d))


class InterleavedPermuted(TrainBlock):
    """`rope_interleave=True` over DeinterleavedRotary: half-split at the product, interleaved in the weights' layout."""

    rotary_class = DeinterleavedRotary

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_interleave=True):
        super().__init__(d_model, n_heads, dropout, causal)


PLANTED = {"RotaryBaseIgnored": "rope.theta", "SoftcapIgnored": "attn.softcap",
           "ScaleAttributeContradicted": "attn.scale", "ActivationContradicted": "ffn.act", "NormEpsIgnored": "norm.eps",
           "PartialRotationIgnored": "rope.dims", "RotaryDropped": "pos.kind", "RotaryOnQueries": "pos.kind",
           "RopeScalingIgnored": ("rope.scaling", "rope.factor"), "ParallelResidualIgnored": "residual.form",
           "RMSNormCentred": "norm.kind", "KVHeadsIgnored": "attn.group", "PairingContradicted": "rope.pairing"}
CORRECT = ["RotaryBaseHonoured", "SoftcapApplied", "ScaleAttributeHonoured", "ActivationHonoured", "PartialRotationHonoured",
           "RotaryKeptUnused", "RopeScalingHonoured", "ParallelResidualHonoured", "LayerNormStreamRMSHeads",
           "ZeroQueryInit", "GroupedQuery", "DifferentialHeads", "PairingHonoured", "InterleavedSaid",
           "InterleavedPermuted"]
# Run without --causal: what the block says of its causality is what the `causal` check holds it to.
SAID_CAUSAL = ["MaskForgotten", "NamedBlock"]
SAID_CAUSAL_CORRECT = ["TrainBlock", "NamedBlockMasked"]
