"""A Llama decoder layer written by hand, with a bug real ports have shipped: the rotary base ignores `rope_theta`.

    tblock spec --block examples/llama_layer.py:LlamaLayer --d-model 64 --n-heads 4 --d-ff 256 \
        --kwargs '{"rope_theta": 500000}' --like hf:llama --like-kwargs '{"rope_theta": 500000}'

Every property check passes (shape, gradients, causality, relative positions...): the block is consistent, it is just
not the Llama-3 it claims to be. `FIXED = True` makes it honour its theta.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = False


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaLayer(nn.Module):
    def __init__(self, d_model=64, n_heads=4, d_ff=256, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.hd = n_heads, d_model // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d_model), RMSNorm(d_model)
        base = rope_theta if FIXED else 10000.0  # the bug: the configured theta never reaches the frequencies
        self.register_buffer("inv_freq", base ** (-torch.arange(0, self.hd, 2).float() / self.hd), persistent=False)

    def rotate(self, t):  # (B, nh, T, hd), rotate-half pairing as Hugging Face lays it out
        angles = torch.arange(t.shape[-2], device=t.device).float()[:, None] * self.inv_freq  # (T, hd/2)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    def forward(self, x):
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(B, T, self.n_heads, self.hd).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)  # (B, nh, T, hd)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
