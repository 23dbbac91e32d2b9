"""Rotations and gains a block states in its own words and computes otherwise: a Llama port's rotary turned the other
way (a sign slipped into rotate-half, positions counted down; nanochat's checkpoints and a block trained from scratch
may turn that way), LongRoPE's short factors (Phi-3's) and its attention factor, a
dynamic NTK scaling (theta's table within its original length, a larger base past it), MiniCPM's depth-scaled
residual (scale_depth / sqrt(num_hidden_layers)), OLMo's clip_qkv and a partial rotation's place in the head (the
first channels, as every transformers family with a partial_rotary_factor rotates them): each planted bug beside a twin
that does what it says."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from zoo_families import HalfRotary
from zoo_training import Rotary, TrainBlock, heads, merge


class BackwardRotary(Rotary):
    """rotate-half with its sign on the wrong half: (x0 cos + x1 sin, x1 cos - x0 sin), each pair turned by -angle.
    Scores still depend on j - i alone; a rotary checkpoint is read mirrored in position."""

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos + t2 * sin, t2 * cos - t1 * sin), dim=-1).flatten(-2)


class CountedDownRotary(Rotary):
    """positions counted from the last token (T - 1 - t): relative again, and turning the other way."""

    def angles(self, T, device):
        return torch.outer(torch.arange(T - 1, -1, -1, device=device, dtype=torch.float32), self.inv_freq.float())


class BackwardHalfRotary(HalfRotary):
    """rotate-half as cat(x2, -x1) where cat(-x2, x1) was meant (a sign slipped): every pair turned by -angle."""

    sign = -1.0


class CountedDownHalfRotary(HalfRotary):
    angles = CountedDownRotary.angles


@dataclass
class PortConfig:
    """The config a port keeps: which family's checkpoints it reads (transformers' model_type) and its base."""

    model_type: str = "llama"
    rope_theta: float = 10000.0


class LlamaPort(TrainBlock):
    """Correct: a Llama port keeping its config; RoPE turns each pair forward, as Llama's checkpoints were trained, in
    their layout (rotate-half)."""

    family, rotary_class = "llama", HalfRotary

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = PortConfig(model_type=self.family)


class RotateHalfSignSlipped(LlamaPort):
    """A Llama port whose rotate-half has its sign slipped: every pair turns backward."""

    rotary_class = BackwardHalfRotary


class PositionsCountedDown(LlamaPort):
    rotary_class = CountedDownHalfRotary


class NanochatPort(LlamaPort):
    """Correct: a nanochat port, turning each pair backward as nanochat's checkpoints do (transformers' NanoChat)."""

    family, rotary_class = "nanochat", BackwardRotary


class BackwardFromScratch(TrainBlock):
    """Correct: a rotary module with base 1e4 that turns backward (modded-nanogpt's and nanochat's own code), in a block
    naming no family whose checkpoints it reads: trained from scratch, either way is RoPE."""

    rotary_class = BackwardRotary


class LongRotary(Rotary):
    """transformers' LongRoPE: pair i turns at theta^(-2i/dim) / factor[i], the short factors up to the original length
    and the long ones past it, and cos and sin times the attention factor sqrt(1 + ln(factor) / ln(original))."""

    def __init__(self, dim, base, short, long, original, longest, swapped=False, gain=True):
        self.short, self.long, self.original, self.swapped = short, long, original, swapped
        self.gain = math.sqrt(1 + math.log(longest / original) / math.log(original)) if gain else 1.0
        super().__init__(dim, base)

    def angles(self, T, device):
        long = (T > self.original) != self.swapped
        ext = torch.tensor(self.long if long else self.short, dtype=torch.float32, device=device)
        plain = 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)
        return torch.outer(torch.arange(T, device=device, dtype=torch.float32), plain / ext)

    def forward(self, t):
        return super().forward(t) * self.gain


def factors(n: int, top: float) -> list[float]:
    """n per-pair divisors rising from 1 to top, as LongRoPE's searched factors do (the slow pairs stretched most)."""
    return [1.0 + (top - 1.0) * (i / max(n - 1, 1)) ** 2 for i in range(n)]


class LongRope(TrainBlock):
    """Correct: Phi-3's config in small (rope_scaling of type longrope beside max_position_embeddings 4096 and an
    original 256: factor 16), its table and attention factor as transformers computes them."""

    swapped, gain = False, True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=10000.0,
                 max_position_embeddings=4096, original_max_position_embeddings=256):
        super().__init__(d_model, n_heads, dropout, causal)
        n = d_model // n_heads // 2
        short, long = factors(n, 1.8), factors(n, 16.0)
        self.rope_scaling = {"type": "longrope", "short_factor": short, "long_factor": long}
        self.rope_theta, self.max_position_embeddings = rope_theta, max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.rotary = LongRotary(2 * n, rope_theta, short, long, original_max_position_embeddings,
                                 max_position_embeddings, self.swapped, self.gain)


class LongRopeFactorsSwapped(LongRope):
    """The long factors within the original length (the length test the wrong way round)."""

    swapped = True


class LongRopeGainDropped(LongRope):
    """LongRoPE's table without its attention factor on cos and sin."""

    gain = False


class DynamicRotary(Rotary):
    """transformers' dynamic NTK: past `original` positions the base grows to
    base * (factor * T / original - (factor - 1)) ** (dim / (dim - 2))."""

    def __init__(self, dim, base, factor, original, always=False):
        self.factor, self.original, self.always = factor, original, always
        super().__init__(dim, base)

    def angles(self, T, device):
        base, seq = self.base, max(T, self.original) if not self.always else T + self.original
        if T > self.original or self.always:
            base = base * (self.factor * seq / self.original - (self.factor - 1)) ** (self.dim / (self.dim - 2))
        inv = 1.0 / base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim)
        return torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)


class DynamicNTK(TrainBlock):
    """Correct: a dynamic scaling over an original 2048 positions, read within them: theta's own table."""

    original, always = 2048, False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=10000.0):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rope_theta, self.max_position_embeddings = rope_theta, self.original
        self.rope_scaling = {"rope_type": "dynamic", "factor": 4.0}
        self.rotary = DynamicRotary(d_model // n_heads, rope_theta, 4.0, self.original, self.always)


class DynamicNTKShortOriginal(DynamicNTK):
    """Correct: an original length of 16, which the card's 64-token probe passes: the base has grown there, and the
    theta the block keeps is not held against it."""

    original = 16


class DynamicNTKAlwaysStretched(DynamicNTK):
    """The grown base at every length (the sequence counted as the original one plus its own): theta's table never."""

    always = True


class DepthScaled(TrainBlock):
    """Correct: MiniCPM's residual, each branch times scale_depth / sqrt(num_hidden_layers) at its add."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, scale_depth=1.4, num_hidden_layers=40):
        super().__init__(d_model, n_heads, dropout, causal)
        self.scale_depth, self.num_hidden_layers = scale_depth, num_hidden_layers

    def gain(self):
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    def forward(self, x):
        x = x + self.gain() * self.drop(self.attention(self.attn_norm(x)))
        return x + self.gain() * self.ffn(self.ffn_norm(x))


class DepthScaleDropped(DepthScaled):
    """Keeps MiniCPM's scale_depth and adds each branch whole."""

    def gain(self):
        return 1.0


class ClippedQKV(TrainBlock):
    """Correct: OLMo's clip_qkv, q, k and v clamped to [-c, c] after their projections."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, clip_qkv=0.5):
        super().__init__(d_model, n_heads, dropout, causal)
        self.clip_qkv = clip_qkv

    def clip(self, t):
        return t.clamp(-self.clip_qkv, self.clip_qkv)

    def attention(self, h):
        q, k, v = (heads(self.clip(p(h)), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class ClipQKVIgnored(ClippedQKV):
    """Keeps clip_qkv 0.5 and clamps nothing."""

    def clip(self, t):
        return t


@dataclass
class PartialConfig:
    partial_rotary_factor: float = 0.5  # no model_type: Phi's family would claim its ungated FFN too


class PartialRotary(torch.nn.Module):
    """A partial rotation, q[..., :half] rotated and the rest passed (Phi's, GPT-NeoX's, StableLM's)."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.inner = Rotary(dim // 2, base)

    def forward(self, t):
        half = t.shape[-1] // 2
        return torch.cat([self.inner(t[..., :half]), t[..., half:]], -1)


class PartialRotaryLast(PartialRotary):
    """The same partial rotation on the head's last channels (q[..., half:]): as many pairs, at the same angles, on
    the channels a checkpoint trained for passing."""

    def forward(self, t):
        half = t.shape[-1] // 2
        return torch.cat([t[..., :half], self.inner(t[..., half:])], -1)


class PartialFirst(TrainBlock):
    """Correct: a partial rotation as Phi's, the head's first half of channels turning (partial_rotary_factor 0.5)."""

    rotary_class = PartialRotary

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = PartialConfig()


class PartialOnTheLastChannels(PartialFirst):
    rotary_class = PartialRotaryLast


PLANTED = {"RotateHalfSignSlipped": "rope.direction", "PositionsCountedDown": "rope.direction",
           "LongRopeFactorsSwapped": "rope.freqs", "LongRopeGainDropped": "attn.scale",
           "DynamicNTKAlwaysStretched": "rope.theta", "DepthScaleDropped": ("residual.attn_gain", "residual.ffn_gain"),
           "ClipQKVIgnored": "attn.clip", "PartialOnTheLastChannels": "rope.place"}
CORRECT = ["LongRope", "DynamicNTK", "DynamicNTKShortOriginal", "DepthScaled", "ClippedQKV", "LlamaPort", "NanochatPort",
           "BackwardFromScratch", "PartialFirst"]
# Correct as to what it says, and judged so by spec; left out of the whole battery's false-alarm sweep: past its
# original 16 positions its table depends on the sequence's length, so the first tokens run alone compute otherwise
# than in the whole sequence, which `causal` reports, truly (a real dynamic scaling starts past 2048 or more)
SPEC_ONLY = ["DynamicNTKShortOriginal"]
