"""What a block says of its randomness and dtype against what its forward does: an attention dropout rate taken and
never passed on (dropout.attention_ignored) or another rate passed in its place (dropout.attention_rate, and
dropout.residual_rate for the sublayers' outputs), a residual dropout rate never applied (dropout.residual_ignored), masks
drawn from NumPy's stream, which torch's checkpoint does not put back for its recompute (checkpointing.host_streams,
a warning), a float64 table from NumPy in the arithmetic (shape.float64), a learnable buffer
(grad_params.buffer_learns), a parameter built narrower than the rest (dtype.narrow_at_build); and correct blocks that
drop attention's probabilities and the sublayers' outputs each way torch offers."""

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


class AttentionDropoutIgnored(TrainBlock):
    """Takes attention_dropout and keeps it; its SDPA call passes dropout_p=0.0 in training too (transformers' SDPA
    paths of several models did): the model trains without the regularisation it was configured with."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attention_dropout=0.1):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attention_dropout = attention_dropout

    def sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=0.0)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(merge(self.sdpa(self.rotary(q), self.rotary(k), v)))


class AttentionDropoutOnOutput(AttentionDropoutIgnored):
    """An nn.Dropout named attn_drop applied to the attention's output instead of its probabilities."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attn_drop=0.1):
        super().__init__(d_model, n_heads, dropout, causal, attention_dropout=0.0)
        self.attn_drop = nn.Dropout(attn_drop)

    def attention(self, h):
        return self.attn_drop(super().attention(h))


class AttentionDropoutSDPA(AttentionDropoutIgnored):
    """Correct: the rate passed to SDPA in training."""

    def sdpa(self, q, k, v):
        p = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=p)


class AttentionRateHardCoded(AttentionDropoutIgnored):
    """Takes attention_dropout (0.1) and passes a constant 0.5 to SDPA in training: a rate, not the one it says."""

    def sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=0.5 if self.training else 0.0)


class AttentionRateFromOtherArgument(AttentionDropoutIgnored):
    """Takes attention_dropout (0.05) beside dropout (0.1), and drops attention's probabilities at `dropout`."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attention_dropout=0.05):
        super().__init__(d_model, n_heads, dropout, causal, attention_dropout)

    def sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)


class AttentionDropoutOnProbs(AttentionDropoutIgnored):
    """Correct: nanoGPT's path without flash attention, an nn.Dropout on the softmax's output."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attn_pdrop=0.1):
        super().__init__(d_model, n_heads, dropout, causal, attention_dropout=0.0)
        self.attn_dropout = nn.Dropout(attn_pdrop)

    def sdpa(self, q, k, v):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        return self.attn_dropout(att.masked_fill(future, float("-inf")).softmax(-1)) @ v


class AttentionDropoutMHA(nn.Module):
    """Correct: nn.MultiheadAttention's own dropout on its probabilities."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attn_dropout=0.1):
        super().__init__()
        self.causal = causal
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.mha = nn.MultiheadAttention(d_model, n_heads, dropout=attn_dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                nn.Dropout(dropout))

    def forward(self, x):
        T = x.shape[1]
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        h = self.ln1(x)
        x = x + self.mha(h, h, h, attn_mask=future, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class ResidualDropoutIgnored(AttentionDropoutSDPA):
    """GPT-2's two rates: attn_pdrop passed to SDPA, resid_pdrop taken and never applied to the sublayers' outputs."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attention_dropout=0.1, resid_pdrop=0.1):
        super().__init__(d_model, n_heads, dropout, causal, attention_dropout)
        self.resid_pdrop = resid_pdrop

    def ffn(self, h):
        return self.w2(F.silu(self.w1(h)) * self.w3(h))

    def residual(self, y):
        return y

    def forward(self, x):
        x = x + self.residual(self.attention(self.attn_norm(x)))
        return x + self.residual(self.ffn(self.ffn_norm(x)))


class ResidualDropoutApplied(ResidualDropoutIgnored):
    """Correct: resid_pdrop on each sublayer's output."""

    def residual(self, y):
        return F.dropout(y, self.resid_pdrop, self.training)


class ResidualRateFromOtherArgument(ResidualDropoutIgnored):
    """Takes resid_pdrop (0.05) beside dropout (0.1), and drops both sublayers' outputs at `dropout`."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, attention_dropout=0.1, resid_pdrop=0.05):
        super().__init__(d_model, n_heads, dropout, causal, attention_dropout, resid_pdrop)

    def residual(self, y):
        return F.dropout(y, self.p, self.training)


class ResidualDropoutOneBranch(ResidualDropoutIgnored):
    """GPT-2's resid_pdrop on the attention's output, forgotten on the MLP's (a port that drops one of two sublayers)."""

    def forward(self, x):
        x = x + F.dropout(self.attention(self.attn_norm(x)), self.resid_pdrop, self.training)
        return x + self.ffn(self.ffn_norm(x))


class ParallelDropoutAdd(ResidualDropoutIgnored):
    """Correct: Falcon's parallel sublayers, one dropout on their sum before the add."""

    def forward(self, x):
        return x + F.dropout(self.attention(self.attn_norm(x)) + self.ffn(self.ffn_norm(x)), self.resid_pdrop,
                             self.training)


class NumPyMasks(TrainBlock):
    """The FFN's dropout masks drawn from NumPy's stream: torch's checkpoint puts back only torch's streams for its
    recompute, which draws other masks, so the weights' gradients are those of masks the forward never used."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if self.training and self.p > 0:
            keep = torch.from_numpy((np.random.rand(*y.shape) >= self.p).astype(np.float32)).to(y.device)
            y = y * keep / (1 - self.p)
        return y


class NumPyTable(TrainBlock):
    """A per-channel FFN scale from a NumPy table: float64, so a float32 block returns float64."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.table = np.linspace(0.5, 1.5, d_model)

    def ffn(self, h):
        return super().ffn(h) * torch.from_numpy(self.table).to(h.device)


class LearnableBuffer(TrainBlock):
    """A learnable FFN output gain registered as a buffer with requires_grad=True: the backward reaches it, and no
    optimizer built from .parameters() ever steps it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("gain", torch.ones(d_model, requires_grad=True))

    def ffn(self, h):
        return super().ffn(h) * self.gain


class GainBuiltInBfloat16(TrainBlock):
    """An output gain created with dtype=torch.bfloat16 in a float32 block: tblock's cast to the run's dtype hides it;
    trained as built, its gradient and update round to bfloat16."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.out_gain = nn.Parameter(torch.ones(d_model, dtype=torch.bfloat16))

    def forward(self, x):
        return super().forward(x) * self.out_gain.to(x.dtype)


class FrozenTableInBfloat16(GainBuiltInBfloat16):
    """Correct: the same gain frozen (a fixed table): nothing trains it, its dtype is a storage choice."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.out_gain.requires_grad_(False)


class _WrittenScores(TrainBlock):
    """Attention written out, its probabilities from `probabilities(scores)`."""

    def probabilities(self, s):
        return s.softmax(-1)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        T = h.shape[1]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
        return self.o_proj(merge(F.dropout(self.probabilities(s), self.p, self.training) @ v))


class SoftmaxInHalf(_WrittenScores):
    """The scores cast to float16 for the softmax and back, whatever the block's dtype (an old fp16 habit): a float32
    block trains on probabilities rounded to 11 bits, a bfloat16 one overflows past 65504; the float64 copy rounds
    the same way, so it agrees."""

    def probabilities(self, s):
        return s.half().softmax(-1).to(s.dtype)


class AutocastInside(TrainBlock):
    """The FFN under an autocast the block enters itself: its products are bfloat16 in a float32 run."""

    def ffn(self, h):
        with torch.autocast(h.device.type, dtype=torch.bfloat16):
            out = super().ffn(h)
        return out.to(h.dtype)


class SoftmaxUpcast(_WrittenScores):
    """Correct: transformers' idiom, the softmax in float32 and back to the scores' dtype (no narrowing in float32)."""

    def probabilities(self, s):
        return s.softmax(-1, dtype=torch.float32).to(s.dtype)


class HalfTableTimesStream(TrainBlock):
    """Correct for dtype: a gain table kept in bfloat16 (a constant, not the stream) multiplies the float32 output,
    which type promotion keeps float32."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("table", torch.linspace(0.5, 1.5, d_model).bfloat16())

    def ffn(self, h):
        return super().ffn(h) * self.table


PLANTED = {"AttentionDropoutIgnored": "dropout.attention_ignored", "AttentionDropoutOnOutput": "dropout.attention_ignored",
           "AttentionRateHardCoded": "dropout.attention_rate", "AttentionRateFromOtherArgument": "dropout.attention_rate",
           "ResidualDropoutIgnored": "dropout.residual_ignored", "ResidualRateFromOtherArgument": "dropout.residual_rate", "ResidualDropoutOneBranch": "dropout.residual_one_branch",
           "NumPyMasks": "checkpointing.host_streams", "NumPyTable": "shape.float64",
           "LearnableBuffer": "grad_params.buffer_learns", "GainBuiltInBfloat16": "dtype.narrow_at_build",
           "SoftmaxInHalf": "dtype.narrowed", "AutocastInside": "dtype.narrowed"}
WARNED = {"checkpointing.host_streams"}
CORRECT = ["AttentionDropoutSDPA", "AttentionDropoutOnProbs", "AttentionDropoutMHA", "FrozenTableInBfloat16",
           "ResidualDropoutApplied", "ParallelDropoutAdd", "SoftmaxUpcast", "HalfTableTimesStream"]
