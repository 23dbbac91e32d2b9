"""What a family computes with no config field saying it, claimed by the `model_type` a port's config keeps: Qwen3's
per-head norms on q and k, Gemma's (1 + w) RMSNorm, Cohere's parallel sublayers, Llama's gated FFN, RMSNorm and
rotate-half pairing, Qwen2's q/k/v biases. Each planted port leaves one out and fails `spec` naming the entry; each twin passes."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_switches import OffsetRMSNorm  # Gemma's (1 + w) RMSNorm, started at 0, as Megatron's zero-centred gamma
from zoo_training import RMSNorm, Rotary, TrainBlock, heads, merge


class HalfRotary(Rotary):
    """The same rotation in transformers' layout (rotate_half): channel i turns with i + dims/2, as the checkpoints of
    a family whose config a port keeps (Llama's, Qwen's, Gemma's) pair them."""

    sign = 1.0  # -1: the sign slipped into rotate-half, every pair turned the other way

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        cos, sin = freqs.cos().to(t.dtype), (self.sign * freqs.sin()).to(t.dtype)
        t1, t2 = t.chunk(2, -1)
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)


@dataclass
class FamilyConfig:
    model_type: str = "qwen3"
    rms_norm_eps: float = 1e-6


class FamilyPort(TrainBlock):
    """A port keeping its family's config (`family`, the config's model_type), rotating as the family's checkpoints
    pair the channels (transformers' rotate-half layout unless the family says otherwise)."""

    family = "llama"
    rotary_class = HalfRotary

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = FamilyConfig(model_type=self.family)


class Qwen3Port(FamilyPort):
    """Correct: Qwen3's attention, an RMSNorm over each head's channels on q and on k before the rotation."""

    family = "qwen3"

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_norm, self.k_norm = RMSNorm(d_model // n_heads), RMSNorm(d_model // n_heads)

    def qk(self, q, k):
        return self.q_norm(q), self.k_norm(k)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.qk(q, k)
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=self.causal,
                                           dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class Qwen3PortWithoutQKNorm(Qwen3Port):
    """A Qwen3 port written from Qwen2's layer: no norm on q and k (the norms' weights would load unused)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.q_norm, self.k_norm

    def qk(self, q, k):
        return q, k


class GemmaPort(FamilyPort):
    """Correct: Gemma's (1 + w) RMSNorms."""

    family = "gemma"
    norm_class = OffsetRMSNorm


class GemmaPortPlainNorm(GemmaPort):
    """A Gemma port with Llama's RMSNorm (weight started at 1, applied as w): the checkpoints' offsets read as gains."""

    norm_class = RMSNorm


class CohereLayerNorm(nn.LayerNorm):
    """Cohere's LayerNorm: the mean subtracted, no bias."""

    def __init__(self, d, eps=1e-6):  # the config's eps
        super().__init__(d, eps=eps, bias=False)


class CoherePort(FamilyPort):
    """Correct: Cohere's layer, attention and FFN reading one LayerNorm of the same stream, added together."""

    family = "cohere"
    rotary_class = Rotary  # Cohere's checkpoints pair the channels interleaved
    norm_class = CohereLayerNorm

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.ffn_norm

    def forward(self, x):
        h = self.attn_norm(x)
        return x + self.drop(self.attention(h)) + self.ffn(h)


class CoherePortSequential(CoherePort):
    """A Cohere port with Llama's sequential sublayers (the FFN reads the stream after attention's add)."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.attn_norm(x))


class LlamaPort(FamilyPort):
    """Correct: Llama's layer (its SwiGLU FFN gated)."""


class PlainSiLUMLP:
    """Mixin for a TrainBlock: GPT-2's MLP shape, one SiLU between two projections (the gate's up matrix, w3, removed)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3

    def ffn(self, h):
        return self.drop(self.w2(F.silu(self.w1(h))))


class LlamaPortPlainMLP(PlainSiLUMLP, LlamaPort):
    """A Llama port with GPT-2's MLP shape, one activation between two projections (no up projection to gate)."""


class LlamaPortInterleaved(LlamaPort):
    """A Llama port holding transformers' config with Meta's interleaved rotary (pairs 2i, 2i + 1): transformers'
    checkpoints pair i with i + dims/2, their q/k weights permuted at conversion."""

    rotary_class = Rotary


class ConfigEpsLayerNorm(nn.LayerNorm):
    def __init__(self, d, eps=1e-6):  # the config's eps
        super().__init__(d, eps=eps)


class LlamaPortLayerNorm(LlamaPort):
    """A Llama port with nn.LayerNorm where Llama's RMSNorm is (the mean subtracted, a bias added)."""

    norm_class = ConfigEpsLayerNorm


class Qwen2Port(FamilyPort):
    """Correct: Qwen2's attention, a bias on q, k and v (none on o, none in the MLP)."""

    family = "qwen2"
    qkv_bias = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model, bias=self.qkv_bias) for _ in range(3))


class Qwen2PortWithoutBias(Qwen2Port):
    """A Qwen2 port written from Llama's layer: q, k and v unbiased (the checkpoint's biases would load nowhere)."""

    qkv_bias = False


PLANTED = {"Qwen3PortWithoutQKNorm": "attn.qk_norm", "GemmaPortPlainNorm": "norm.offset",
           "CoherePortSequential": "residual.form", "LlamaPortPlainMLP": "ffn.gated", "LlamaPortLayerNorm": "norm.kind",
           "LlamaPortInterleaved": "rope.pairing", "Qwen2PortWithoutBias": "bias.qkv"}
CORRECT = ["Qwen3Port", "GemmaPort", "CoherePort", "LlamaPort", "Qwen2Port"]
