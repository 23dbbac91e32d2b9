"""Blocks for the ffn, norms and residual entries of the spec card: one configurable block (each planted variant and
its correct twin differ in one argument), and a GPT-2 layer written out by hand with its exact-GELU slip."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6, offset=False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d))

    def forward(self, x):
        w = 1.0 + self.weight if self.offset else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w


class LayerScale(nn.Module):
    """timm's LayerScale: x * gamma, one 1-D parameter of the stream's width (a module a norm finder must not take)."""

    def __init__(self, d, init):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), float(init)))

    def forward(self, x):
        return x * self.gamma


class Block(nn.Module):
    """A causal block: norm "rms" or "ln"; placement "pre", "post" or "sandwich"; a gated or plain FFN (act(gate * up)
    inside one activation with product_inside); a parallel residual; alpha on the stream (DeepNorm) or, wrongly, on the
    branch; a per-channel LayerScale of value `layerscale` on both branches (as timm's LayerScale modules with
    ls_modules); both branches' output projections zero at init with zero_out (modded-nanogpt)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=128, norm="rms", eps=1e-6, offset=False, act="silu", gated=True,
                 product_inside=False, parallel=False, placement="pre", alpha=1.0, alpha_on="stream", layerscale=None,
                 ls_modules=False, zero_out=False):
        super().__init__()
        self.h, self.placement, self.parallel = n_heads, placement, parallel
        self.act, self.gated, self.product_inside = ACTS[act], gated, product_inside
        self.alpha, self.alpha_on = alpha, alpha_on
        make = (lambda: RMSNorm(d_model, eps, offset)) if norm == "rms" else (lambda: nn.LayerNorm(d_model, eps=eps))
        self.n1, self.n2 = make(), make()
        if placement == "sandwich":
            self.n1_post, self.n2_post = make(), make()
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.gate = nn.Linear(d_model, d_ff, bias=False) if gated else None
        self.down = nn.Linear(d_ff, d_model, bias=False)
        if layerscale is not None and ls_modules:
            self.g_attn, self.g_ffn = LayerScale(d_model, layerscale), LayerScale(d_model, layerscale)
        elif layerscale is not None:
            self.g_attn = nn.Parameter(torch.full((d_model,), float(layerscale)))
            self.g_ffn = nn.Parameter(torch.full((d_model,), float(layerscale)))
        self.layerscale, self.ls_modules = layerscale, ls_modules
        if zero_out:
            nn.init.zeros_(self.o.weight)
            nn.init.zeros_(self.down.weight)

    def scaled(self, y, name):
        if self.layerscale is None:
            return y
        g = getattr(self, name)
        return g(y) if self.ls_modules else y * g

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.h, C // self.h).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.o(y.transpose(1, 2).reshape(B, T, C))
        return self.scaled(y, "g_attn")

    def ffn(self, x):
        if not self.gated:
            y = self.down(self.act(self.up(x)))
        elif self.product_inside:
            y = self.down(self.act(self.gate(x) * self.up(x)))
        else:
            y = self.down(self.act(self.gate(x)) * self.up(x))
        return self.scaled(y, "g_ffn")

    def add(self, x, branch):
        return self.alpha * x + branch if self.alpha_on == "stream" else x + self.alpha * branch

    def forward(self, x, pad_mask=None):
        if self.placement == "post":
            x = self.n1(self.add(x, self.attention(x)))
            return self.n2(self.add(x, self.ffn(x)))
        if self.parallel:
            return self.add(x, self.attention(self.n1(x)) + self.ffn(self.n2(x)))
        if self.placement == "sandwich":
            x = self.add(x, self.n1_post(self.attention(self.n1(x))))
            return self.add(x, self.n2_post(self.ffn(self.n2(x))))
        x = self.add(x, self.attention(self.n1(x)))
        return self.add(x, self.ffn(self.n2(x)))


class GPT2Layer(nn.Module):
    """GPT-2's layer written out: pre-LN, causal attention scaled by 1/sqrt(head dim), a tanh-GELU MLP."""

    exact_gelu = False

    def __init__(self, d_model=64, n_heads=4, d_ff=None):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.h = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model, eps=1e-5), nn.LayerNorm(d_model, eps=1e-5)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.fc, self.proj = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-2, -1) / math.sqrt(C // self.h)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        h = self.fc(self.ln_2(x))
        h = F.gelu(h) if self.exact_gelu else F.gelu(h, approximate="tanh")
        return x + self.proj(h)


class GPT2ExactGelu(GPT2Layer):
    exact_gelu = True  # bug: GPT-2 was trained with the tanh approximation (gelu_new)


class DeepNormEncoder(nn.Module):
    """A DeepNorm encoder layer written the torchscale way: post-LN, x = LN(alpha x + f(x)), alpha = (2 N)^(1/4)."""

    alpha_on_branch = False

    def __init__(self, d_model=64, n_heads=4, d_ff=128, layers=6):
        super().__init__()
        self.alpha = (2.0 * layers) ** 0.25
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(0.1)

    def residual_connection(self, x, residual):
        return residual + self.alpha * x if self.alpha_on_branch else residual * self.alpha + x

    def forward(self, x, pad_mask=None):
        residual = x
        x = self.dropout(self.self_attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)[0])
        x = self.self_attn_layer_norm(self.residual_connection(x, residual))
        residual = x
        x = self.dropout(self.fc2(F.gelu(self.fc1(x))))
        return self.final_layer_norm(self.residual_connection(x, residual))


class DeepNormOnBranch(DeepNormEncoder):
    alpha_on_branch = True  # bug: the gain scales the sublayer's output instead of the stream


class NeoXLayer(nn.Module):
    """GPT-NeoX's layer re-written (fused qkv, no rotary here) with the parallel residual forced, whatever the config."""

    parallel = True

    def __init__(self, d_model=64, n_heads=4, d_ff=256):
        super().__init__()
        self.h = n_heads
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.query_key_value, self.dense = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.query_key_value(x).view(B, T, self.h, 3 * (C // self.h)).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))

    def mlp(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))

    def forward(self, x, pad_mask=None):
        a = self.attention(self.input_layernorm(x))
        if self.parallel:
            return x + a + self.mlp(self.post_attention_layernorm(x))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class NeoXSequential(NeoXLayer):
    parallel = False
