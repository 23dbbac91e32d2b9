"""Fine-tuning and reparametrisation designs: LoRA (PEFT's layout, a frozen `base_layer` beside its `lora_A` and
`lora_B`, B started at zero; on q and v alone, and on every projection with the rest frozen), DoRA (a magnitude times the
direction of the frozen weight plus B A), torch's spectral norm on the output projection (sigma-reparam: a power
iteration updates its `_u` and `_v` in every training forward), weight norm on the FFN, Houlsby's bottleneck adapters
after each sublayer, IA3's scaling vectors and an int8 base beside LoRA (QLoRA's shape). Each is a correct twin
that must pass the whole battery; `FrozenProjection` freezes o_proj's weight with no adapter beside it, a slip that
is still warned, and `DetachedNormStats` detaches a norm's statistics, a stop-gradient on the data that still fails. Each block is `TrainBlock` with one thing changed; `--block tests/zoo_adapters.py:NAME` builds it."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import spectral_norm, weight_norm
from zoo_training import RMSNorm, TrainBlock, heads, merge


class LoraLinear(nn.Module):
    """PEFT's LoRA layer: the frozen base's output plus B(A(dropout(x))) * alpha / r, A Kaiming-uniform, B zero."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: int = 8, dropout: float = 0.05):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout)})
        self.scaling = alpha / r

    def forward(self, x):
        lora = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        return self.base_layer(x) + lora * self.scaling


class LoraQV(TrainBlock):
    """Correct: LoRA on q and v (PEFT's default targets), their bases frozen, everything else trained."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj, self.v_proj = LoraLinear(self.q_proj), LoraLinear(self.v_proj)


class LoraEverywhere(TrainBlock):
    """Correct: LoRA on every projection and nothing else trained (the norms frozen too): the FFN's adapters are
    linear bottlenecks by design, beside projections that keep their activation."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.requires_grad_(False)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"):
            setattr(self, name, LoraLinear(getattr(self, name)))


class DoraV(TrainBlock):
    """Correct: DoRA on v: a trained magnitude per output row times the direction of the frozen weight plus B A (the
    norm detached, as the paper does), B started at zero."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.v_proj.requires_grad_(False)
        self.v_A = nn.Parameter(torch.randn(4, d_model) / math.sqrt(d_model))
        self.v_B = nn.Parameter(torch.zeros(d_model, 4))
        self.v_m = nn.Parameter(self.v_proj.weight.detach().norm(dim=1).clone())

    def attention(self, h):
        w = self.v_proj.weight + self.v_B @ self.v_A
        w = w / w.norm(dim=1, keepdim=True).detach() * self.v_m[:, None]
        q, k, v = heads(self.q_proj(h), self.n_heads), heads(self.k_proj(h), self.n_heads), heads(F.linear(h, w), self.n_heads)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class SpectralOut(TrainBlock):
    """Correct: torch's spectral norm on the output projection (sigma-reparam). Its power iteration runs in every
    training forward, in a checkpoint's recompute too (torch's, not the block's)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.o_proj = spectral_norm(self.o_proj)


class WeightNormFFN(TrainBlock):
    """Correct: torch's weight norm on the FFN's projections."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.w1, self.w2, self.w3 = weight_norm(self.w1), weight_norm(self.w2), weight_norm(self.w3)


class Houlsby(TrainBlock):
    """Correct: Houlsby adapters, a bottleneck MLP (down, GELU, up started at zero) with its own residual after each
    sublayer's output, the base frozen: the adapter reads a sublayer's output, not the stream (no norm before it), and
    its down projection follows the FFN's with no activation between, the FFN's output added on its own as well."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.requires_grad_(False)
        self.adapter_attn, self.adapter_ffn = self._adapter(d_model), self._adapter(d_model)

    @staticmethod
    def _adapter(d: int) -> nn.Sequential:
        a = nn.Sequential(nn.Linear(d, 8), nn.GELU(), nn.Linear(8, d))
        nn.init.zeros_(a[2].weight)
        nn.init.zeros_(a[2].bias)
        return a

    def forward(self, x):
        a = self.drop(self.attention(self.attn_norm(x)))
        x = x + a + self.adapter_attn(a)
        f = self.ffn(self.ffn_norm(x))
        return x + f + self.adapter_ffn(f)


class IA3(TrainBlock):
    """Correct: IA3, learned vectors scaling k, v and the FFN's hidden units (started at 1), everything else frozen."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.requires_grad_(False)
        self.ia3_k, self.ia3_v = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.ones(d_model))
        self.ia3_ff = nn.Parameter(torch.ones(self.w1.out_features))

    def attention(self, h):
        q = heads(self.q_proj(h), self.n_heads)
        k, v = heads(self.k_proj(h) * self.ia3_k, self.n_heads), heads(self.v_proj(h) * self.ia3_v, self.n_heads)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))

    def ffn(self, h):
        return self.drop(self.w2(F.silu(self.w1(h)) * self.w3(h) * self.ia3_ff))


class QuantisedBaseLora(TrainBlock):
    """Correct: QLoRA's shape, the FFN's down weight kept as int8 rows and a scale (buffers, dequantised in the
    forward), a LoRA pair beside it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        w = self.w2.weight.detach()
        scale = w.abs().amax(1, keepdim=True) / 127
        self.register_buffer("w2_q", torch.round(w / scale).to(torch.int8))
        self.register_buffer("w2_scale", scale)
        del self.w2
        self.lora_A = nn.Parameter(torch.randn(4, w.shape[1]) / math.sqrt(w.shape[1]))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], 4))

    def ffn(self, h):
        a = F.silu(self.w1(h)) * self.w3(h)
        w = self.w2_q.to(a.dtype) * self.w2_scale.to(a.dtype)
        return self.drop(F.linear(a, w) + (a @ self.lora_A.t()) @ self.lora_B.t() * 2.0)


class DetachedStatsRMSNorm(RMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).detach() * self.weight


class DetachedNormStats(TrainBlock):
    """DoRA's stop-gradient written on the data instead: the norms' RMS detached, so the backward treats each token's
    scale as a constant (every step's gradient off, not an approximation a design documents)."""

    norm_class = DetachedStatsRMSNorm


class FrozenProjection(TrainBlock):
    """o_proj's weight frozen by mistake, with no adapter beside it: never trained."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.o_proj.weight.requires_grad_(False)


CORRECT = ["LoraQV", "LoraEverywhere", "DoraV", "SpectralOut", "WeightNormFFN", "Houlsby", "IA3", "QuantisedBaseLora"]
WARNED = {"FrozenProjection": "optimizer_step.frozen"}
PLANTED = {"DetachedNormStats": "derivative.wrong"}
