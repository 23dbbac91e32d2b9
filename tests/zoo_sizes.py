"""What a block says of its sizes and gains, contradicted and honoured: its head count (attn.heads), a config's FFN
width (ffn.hidden), LayerScale's start (the branch gains), its activation on a GLU (ffn.act), a window it says it
does not have (attn.window none) and whether its projections add a bias (bias.*). Each planted block fails `spec`
naming the entry; each twin passes."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_numerics import WindowKeptNotApplied
from zoo_training import Rotary, TrainBlock, heads, merge


class HeadsIgnored(TrainBlock):
    """Built with n_heads and splitting into 2 heads whatever it was given (a port that reads another config field):
    the projections' shapes do not change, so every checkpoint loads and computes other attention. Twin: any block
    that honours n_heads (zoo_claims' GroupedQuery; DifferentialHeads splits each head in two, a multiple)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.n_heads = 2
        self.rotary = Rotary(d_model // 2)


class HeadsInALoop(TrainBlock):
    """Correct: n_heads honoured one head at a time, a Python loop over slices of the projections (each a single-head
    softmax of its own): counted as n_heads single-head calls, not as one head."""

    def attention(self, h):
        q, k, v = (p(h) for p in (self.q_proj, self.k_proj, self.v_proj))
        T, hd = h.shape[1], q.shape[-1] // self.n_heads
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        outs = []
        for i in range(self.n_heads):
            part = slice(i * hd, (i + 1) * hd)
            s = (q[..., part] @ k[..., part].transpose(-2, -1) / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
            outs.append(F.dropout(s.softmax(-1), self.p, self.training) @ v[..., part])
        return self.o_proj(torch.cat(outs, -1))


@dataclass
class MLPConfig:
    intermediate_size: int = 96


class FFNWidthIgnored(TrainBlock):
    """Keeps a config's intermediate_size and sizes its SwiGLU by llama's 8/3 d_model whatever the config says (a port's
    hard-coded rule). Twin: FFNWidthHonoured."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, intermediate_size=96):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = MLPConfig(intermediate_size)


class FFNWidthHonoured(FFNWidthIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, intermediate_size=96):
        super().__init__(d_model, n_heads, dropout, causal, intermediate_size)
        self.w1, self.w3 = (nn.Linear(d_model, intermediate_size, bias=False) for _ in range(2))
        self.w2 = nn.Linear(intermediate_size, d_model, bias=False)


class SiluOnBothHalves(TrainBlock):
    """Says hidden_act silu and applies it to both halves of its GLU: silu(gate) * silu(up), no SwiGLU. Twin: any
    block that says silu over silu(gate) * up (zoo_claims' twins)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, hidden_act="silu"):
        super().__init__(d_model, n_heads, dropout, causal)
        self.hidden_act = hidden_act

    def ffn(self, h):
        return self.drop(self.w2(F.silu(self.w1(h)) * F.silu(self.w3(h))))


class LayerScaleIgnored(TrainBlock):
    """Built with layer_scale_init_value 1e-5 (CaiT's, DeiT III's) and starting both branch gains at 1: the deep
    stack it was meant for trains unstably. Twin: LayerScaleHonoured."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, layer_scale_init_value=1e-5):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gamma_1, self.gamma_2 = (nn.Parameter(torch.ones(d_model)) for _ in range(2))

    def forward(self, x):
        x = x + self.gamma_1 * self.drop(self.attention(self.attn_norm(x)))
        return x + self.gamma_2 * self.ffn(self.ffn_norm(x))


class LayerScaleHonoured(LayerScaleIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, layer_scale_init_value=1e-5):
        super().__init__(d_model, n_heads, dropout, causal, layer_scale_init_value)
        self.gamma_1, self.gamma_2 = (nn.Parameter(torch.full((d_model,), layer_scale_init_value)) for _ in range(2))


class WindowWhereNone(WindowKeptNotApplied):
    """Keeps sliding_window=None (every key, as a full-attention layer of a sliding family keeps it) and masks to the
    last 4 keys anyway: a window default of its own (`self.sliding_window or 4`). Twin: WindowNoneHonoured."""

    applied, window = True, 4

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, sliding_window=None):
        super().__init__(d_model, n_heads, dropout, causal, sliding_window)


class WindowNoneHonoured(WindowWhereNone):
    window = 10**9


class SinksBesideWindow(WindowKeptNotApplied):
    """Correct: StreamingLLM's mask, the first two keys (attention sinks) seen by every later query beside a sliding
    window of 4: the window is the band the other keys are seen in. Twin: SinksBesideWiderWindow."""

    width = 4

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, sliding_window=4, sink_tokens=2):
        super().__init__(d_model, n_heads, dropout, causal, sliding_window)
        self.sink_tokens = sink_tokens

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        i = torch.arange(h.shape[1], device=h.device)
        d = i[:, None] - i[None, :]
        allowed = (d >= 0) & ((d < self.width) | (i[None, :] < self.sink_tokens))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class SinksBesideWiderWindow(SinksBesideWindow):
    """Says sliding_window=4 beside its sinks and slides 8 keys."""

    width = 8


@dataclass
class SlidingConfig:
    use_sliding_window: bool = False
    sliding_window: int = 4


class WindowSwitchedOffIgnored(WindowWhereNone):
    """Qwen2's config: use_sliding_window=False beside a sliding_window of 4; the layer slides anyway (the switch
    never read). Twin: WindowSwitchedOffHonoured."""

    honoured = False

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, config=None):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = config or SlidingConfig()
        self.sliding_window = None if self.honoured else self.config.sliding_window


class WindowSwitchedOffHonoured(WindowSwitchedOffIgnored):
    honoured = True
    window = 10**9


class WindowArgumentsSwitchedOff(WindowKeptNotApplied):
    """Both as constructor arguments: use_sliding_window=False beside sliding_window=4, and the mask slides anyway.
    The switch wins over the window beside it (Qwen2's reading), so the block says it has none. Twin:
    WindowArgumentsHonoured."""

    applied = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, use_sliding_window=False, sliding_window=4):
        super().__init__(d_model, n_heads, dropout, causal, sliding_window)
        self.applied = use_sliding_window or type(self).applied


class WindowArgumentsHonoured(WindowArgumentsSwitchedOff):
    applied = False


class BiasIgnored(TrainBlock):
    """Takes bias=False (nanoGPT's switch: no bias in any linear) and builds biased attention projections anyway."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, bias=False):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=not bias) for _ in range(4))


class QKVBiasKeptApart(TrainBlock):
    """Correct: BEiT's qkv_bias=True: q and v biases kept beside one bias-free fused projection (k none), passed to
    F.linear in the forward."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, qkv_bias=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(d_model)), nn.Parameter(torch.zeros(d_model))

    def attention(self, h):
        b = torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias])
        q, k, v = (heads(t, self.n_heads) for t in F.linear(h, self.qkv.weight, b).chunk(3, -1))
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=self.causal,
                                           dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class NoBiasHonoured(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, bias=False):
        super().__init__(d_model, n_heads, dropout, causal)  # bias-free projections, as bias=False asks


class QKVBiasBesideNoBias(TrainBlock):
    """Correct: litgpt's Qwen2 config, `bias=False` for every linear but q, k and v, whose bias `attn_bias=True` adds
    (the generic False yields to the specific True)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, bias=False, attn_bias=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model, bias=attn_bias) for _ in range(3))


PLANTED = {"HeadsIgnored": "attn.heads", "FFNWidthIgnored": "ffn.hidden", "SiluOnBothHalves": "ffn.act",
           "LayerScaleIgnored": ("residual.attn_gain", "residual.ffn_gain"), "WindowWhereNone": "attn.window",
           "WindowSwitchedOffIgnored": "attn.window", "BiasIgnored": "bias.any", "SinksBesideWiderWindow": "attn.window",
           "WindowArgumentsSwitchedOff": "attn.window"}
CORRECT = ["FFNWidthHonoured", "LayerScaleHonoured", "HeadsInALoop", "WindowNoneHonoured", "WindowSwitchedOffHonoured",
           "QKVBiasKeptApart", "NoBiasHonoured", "QKVBiasBesideNoBias", "SinksBesideWindow", "WindowArgumentsHonoured"]
