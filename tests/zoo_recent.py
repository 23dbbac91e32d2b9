"""Designs of recent papers that earlier versions raised alarms on: Primer-EZ (a causal depthwise convolution of
width 3 over time after each of q, k and v, before the rotation, and a squared-ReLU FFN), whose rotation the card read
as none from the first token on, where the convolution sees its zero padding; and differential attention (two softmax
maps subtracted with a learned lambda, a per-head RMSNorm after); and Conformer's block, whose convolution over time
`order` warned as scrambled positions. Each must pass the whole battery."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import RMSNorm, TrainBlock, heads, merge


class PrimerEZ(TrainBlock):
    """Correct: Primer-EZ's depthwise convolutions (causal, width 3) on q, k and v, rotary after, squared ReLU."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.dconv = nn.ModuleList(nn.Conv1d(d_model, d_model, 3, groups=d_model, padding=2) for _ in range(3))
        del self.w3

    def attention(self, h):
        T = h.shape[1]

        def conv(i, t):  # padded on both sides, the last two outputs dropped: each position sees itself and 2 before
            return self.dconv[i](t.transpose(1, 2))[..., :T].transpose(1, 2)

        q, k, v = (heads(conv(i, p(h)), self.n_heads) for i, p in enumerate((self.q_proj, self.k_proj, self.v_proj)))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))

    def ffn(self, h):
        return self.drop(self.w2(F.relu(self.w1(h)).square()))


class DifferentialAttention(TrainBlock):
    """Correct: DIFF Transformer's attention, softmax(q1 k1) - lambda softmax(q2 k2) over values of twice the half-head
    width, lambda from four learned vectors plus lambda_init, a per-head RMSNorm, times 1 - lambda_init."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, depth=0):
        super().__init__(d_model, n_heads, dropout, causal)
        self.half = d_model // n_heads // 2
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(self.half) * 0.1) for _ in range(4))
        self.subln = RMSNorm(2 * self.half)

    def attention(self, h):
        B, T, C = h.shape
        H = self.n_heads
        q = self.q_proj(h).view(B, T, 2 * H, self.half).transpose(1, 2)
        k = self.k_proj(h).view(B, T, 2 * H, self.half).transpose(1, 2)
        v = self.v_proj(h).view(B, T, H, 2 * self.half).transpose(1, 2)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.half)
        mask = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        a = s.masked_fill(~mask, float("-inf")).softmax(-1).view(B, H, 2, T, T)
        lam = (torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
               + self.lambda_init)
        a = a[:, :, 0] - lam * a[:, :, 1]
        y = self.subln(F.dropout(a, self.p, self.training) @ v) * (1 - self.lambda_init)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class Conformer(nn.Module):
    """Correct: a Conformer block (bidirectional): half-step FFN, self-attention, the convolution module (pointwise
    GLU, depthwise convolution of width 7 over time, BatchNorm, SiLU, pointwise), half-step FFN, a final LayerNorm. Its
    convolution gives it positions: permuted tokens are not the same tokens permuted."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1):
        super().__init__()
        self.ff1, self.ff2 = self._ffn(d_model, dropout), self._ffn(d_model, dropout)
        self.ln_att, self.ln_conv, self.ln_out = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.pointwise_in = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise = nn.Conv1d(d_model, d_model, 7, padding=3, groups=d_model)
        self.bn = nn.BatchNorm1d(d_model)
        self.pointwise_out = nn.Conv1d(d_model, d_model, 1)
        self.drop = nn.Dropout(dropout)

    @staticmethod
    def _ffn(d: int, dropout: float) -> nn.Sequential:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(4 * d, d),
                             nn.Dropout(dropout))

    def forward(self, x):
        x = x + 0.5 * self.ff1(x)
        h = self.ln_att(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        c = F.glu(self.pointwise_in(self.ln_conv(x).transpose(1, 2)), dim=1)
        x = x + self.drop(self.pointwise_out(F.silu(self.bn(self.depthwise(c)))).transpose(1, 2))
        return self.ln_out(x + 0.5 * self.ff2(x))


CORRECT = ["PrimerEZ", "DifferentialAttention", "Conformer"]
BIDIRECTIONAL = ["Conformer"]
