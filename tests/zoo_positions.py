"""Positions inside the block (rotary, ALiBi, absolute, windows, GQA), correct and with the bugs real projects shipped
(the relative, position_bias and padding checks catch them)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_correct import Good, UpcastRMSNorm, heads, merge


def rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


def rope_freqs(pos, dim, angle_dtype=torch.float32, base=10000.0):
    """(B, T) positions -> (B, 1, T, dim / 2) angles, computed in angle_dtype."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    return (pos.to(angle_dtype)[..., None] * inv.to(angle_dtype))[:, None]


def sinusoid(pos, d):
    """(B, T) positions -> (B, T, d) sinusoidal absolute position vectors."""
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    a = pos.float()[..., None] * inv
    return torch.cat((a.sin(), a.cos()), dim=-1)


class Rel3(nn.Module):
    """Correct: Llama-style, RoPE (rotate_half layout, angles in float32), attention written out, finite mask fills,
    SwiGLU FFN with its residual dropout a plain float `p`."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True, n_kv_heads=None, window=None):
        super().__init__()
        self.n, self.nkv, self.hd = n_heads, n_kv_heads or n_heads, d_model // n_heads
        self.causal, self.window, self.p = causal, window, dropout
        self.attn_norm = UpcastRMSNorm(d_model)
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d_model, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = UpcastRMSNorm(d_model)
        hidden = d_ff or 2 * d_model
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def positions(self, pad_mask, B, T, device):
        return torch.arange(T, device=device).expand(B, T)  # a relative scheme needs no restart after padding

    def key_positions(self, pos):
        return pos

    def cos_sin(self, pos, dtype):
        f = rope_freqs(pos, self.hd)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, t, pos, sign=1.0):
        cos, sin = self.cos_sin(pos, t.dtype)
        return t * cos + sign * rotate_half(t) * sin

    def bias(self, T, device, dtype):
        return None

    def allowed(self, B, T, pad_mask, device):
        a = torch.ones(T, T, dtype=torch.bool, device=device)
        if self.causal:
            a = a.tril()
        if self.window:
            a = a & ~torch.ones_like(a).tril(-self.window)
        a = a[None, None]
        return a if pad_mask is None else a & ~pad_mask[:, None, None, :]

    def fill(self, s, allowed):
        return s.masked_fill(~allowed, torch.finfo(s.dtype).min)

    def softmax(self, s):
        return torch.softmax(s, dim=-1)

    def attend(self, q, k, v, allowed):
        s = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        b = self.bias(q.shape[-2], q.device, q.dtype)
        if b is not None:
            s = s + b
        return self.softmax(self.fill(s, allowed)) @ v

    def values(self, v, pos):
        return v

    def unvalues(self, y, pos):
        return y

    def attention(self, h, pad_mask):
        B, T, _ = h.shape
        q, k, v = heads(self.q_proj(h), self.n), heads(self.k_proj(h), self.nkv), heads(self.v_proj(h), self.nkv)
        pos = self.positions(pad_mask, B, T, h.device)
        q, k, v = self.rotate(q, pos), self.rotate(k, self.key_positions(pos)), self.values(v, pos)
        if self.nkv != self.n:
            k, v = k.repeat_interleave(self.n // self.nkv, dim=1), v.repeat_interleave(self.n // self.nkv, dim=1)
        y = self.unvalues(self.attend(q, k, v, self.allowed(B, T, pad_mask, h.device)), pos)
        return self.o_proj(merge(y))

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


def GQA3(d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
    """Correct: grouped-query attention, two query heads per key/value head."""
    return Rel3(d_model, n_heads, d_ff, dropout, causal, n_kv_heads=max(1, n_heads // 2))


def Window3(d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
    """Correct: sliding-window attention (each token sees itself and the 3 before it)."""
    return Rel3(d_model, n_heads, d_ff, dropout, causal, window=4)


def alibi_slopes(n):
    """The ALiBi paper's slopes: geometric from 2^(-8/n), for n a power of two (interleaved otherwise)."""
    p = 2 ** math.floor(math.log2(n))
    first = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    return first + alibi_slopes(2 * p)[0::2][: n - p] if p < n else first


class Alibi3(Rel3):
    """Correct: ALiBi (no rotation; a per-head bias -m_h |i - j| added to the scaled scores)."""

    def slopes(self):
        return torch.tensor(alibi_slopes(self.n))

    def rotate(self, t, pos, sign=1.0):
        return t

    def bias(self, T, device, dtype):
        i = torch.arange(T, device=device)
        dist = (i[:, None] - i[None, :]).abs().float()
        return (-self.slopes().to(device)[:, None, None] * dist).to(dtype)[None]  # (1, nh, T, T)


class AbsPos3(Rel3):
    """Correct: sinusoidal absolute positions added inside the block, counted from each sample's first real token."""

    def rotate(self, t, pos, sign=1.0):
        return t

    def positions(self, pad_mask, B, T, device):
        if pad_mask is None:
            return torch.arange(T, device=device).expand(B, T)
        return ((~pad_mask).long().cumsum(-1) - 1).clamp(min=0)

    def forward(self, x, pad_mask=None):
        pos = self.positions(pad_mask, x.shape[0], x.shape[1], x.device)
        x = x + self.attention(self.attn_norm(x) + sinusoid(pos, x.shape[-1]).to(x.dtype), pad_mask)
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


class Mask3D3(Rel3):
    """Correct: the padding mask turned into one (B, T, T) additive mask before the heads see it."""

    def attention(self, h, pad_mask):
        self._mask3d = None
        B, T, _ = h.shape
        keep = self.allowed(B, T, pad_mask, h.device)[:, 0].expand(B, T, T)  # (B, T, T)
        self._mask3d = torch.zeros(B, T, T, dtype=h.dtype, device=h.device).masked_fill(~keep, torch.finfo(h.dtype).min)
        return super().attention(h, pad_mask)

    def fill(self, s, allowed):
        return s + self._mask3d[:, None]


class Fp16Llama3(Rel3):
    """Correct: written for fp16: softmax in float32, mask fills at the dtype's minimum, the norm upcasts."""

    def softmax(self, s):
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(s.dtype)


class Gemma3(Rel3):
    """Correct: Gemma-style (1 + w) norms with w = 0 at init, the second one fused with the residual add."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.attn_norm = UpcastRMSNorm(d_model, offset=1.0)
        self.ffn_norm = UpcastRMSNorm(d_model, offset=1.0)

    def forward(self, x, pad_mask=None):
        a = self.attention(self.attn_norm(x), pad_mask)
        h, x = self.ffn_norm(a, x)
        return x + F.dropout(self.ffn(h), self.p, self.training)


class RoPEValues3(Rel3):
    """Correct: values rotated at their positions and the weighted sum rotated back at the query's."""

    def values(self, v, pos):
        return self.rotate(v, pos)

    def unvalues(self, y, pos):
        return self.rotate(y, pos, sign=-1.0)


class RoPELayoutMismatch(Rel3):
    def cos_sin(self, pos, dtype):
        emb = rope_freqs(pos, self.hd).repeat_interleave(2, dim=-1)  # bug: interleaved-pair angles, half-split rotation
        return emb.cos().to(dtype), emb.sin().to(dtype)


class ValuesNotRotatedBack(RoPEValues3):
    def unvalues(self, y, pos):
        return y  # bug: values rotated, the weighted sum never rotated back


class AbsPosNoRestart(AbsPos3):
    def positions(self, pad_mask, B, T, device):
        return torch.arange(T, device=device).expand(B, T)  # bug: left padding shifts every real token's position


class RoPEAnglesHalf(Rel3):
    def cos_sin(self, pos, dtype):
        f = rope_freqs(pos, self.hd, angle_dtype=dtype)  # bug: positions x frequencies in the run dtype (bf16: 8 bits)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()


class LeftPadNaN(Rel3):
    def fill(self, s, allowed):
        return s.masked_fill(~allowed, float("-inf"))  # bug: a fully masked row (a left pad under causal) gives NaN


class AlibiWrongSlopes(Alibi3):
    def slopes(self):
        return torch.arange(1, self.n + 1, dtype=torch.float32) / self.n  # bug: linear slopes, not the geometric set


class AlibiSlopesReversed(Alibi3):
    def slopes(self):
        return super().slopes().flip(0)  # bug: the paper's slopes, last head first (a checkpoint's heads mismatch)


class AlibiBeforeScale(Alibi3):
    """Correct: Falcon's order (tiiuae/falcon-rw-*, alibi=True): the paper's bias added to q.k before the scores are
    scaled by 1/sqrt(d_head), so the logits carry the paper's slopes over sqrt(d_head), as the checkpoints were trained."""

    def slopes(self):
        return super().slopes() / math.sqrt(self.hd)


class AlibiHalved(Alibi3):
    def slopes(self):
        return super().slopes() / 2  # bug: the paper's set halved (no convention's), a checkpoint's biases off 2x


class CrossToLatents(Good):
    """Correct: a second attention, from the tokens to 5 learned latent vectors (scores of 10 x 5: not square)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.latents = nn.Parameter(torch.randn(1, 5, d_model))
        self.lnx = nn.LayerNorm(d_model)
        self.xattn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        m = self.latents.expand(x.shape[0], -1, -1)
        x = x + self.xattn(self.lnx(x), m, m, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


class LayerScaleRoPEValues(RoPEValues3):
    """Correct: RoPEValues3 behind LayerScale started at 1e-5 on both branches: every output difference is 1e-5 of
    the attention's, so padding judges it against the block's update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        d = self.q_proj.in_features
        self.g_attn, self.g_ffn = nn.Parameter(torch.full((d,), 1e-5)), nn.Parameter(torch.full((d,), 1e-5))

    def forward(self, x, pad_mask=None):
        x = x + self.g_attn * self.attention(self.attn_norm(x), pad_mask)
        return x + self.g_ffn * F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


class LayerScaleValuesNotRotatedBack(LayerScaleRoPEValues):
    def unvalues(self, y, pos):
        return y  # bug: values rotated, never rotated back (ValuesNotRotatedBack), behind LayerScale 1e-5


class LayerScaleLengthTemperature(LayerScaleRoPEValues):
    def attend(self, q, k, v, allowed):
        T = q.shape[-2]
        return super().attend(q * math.log(T + 1) / math.log(17), k, v, allowed)  # bug: a temperature read off T


class KeysOnePositionAhead(Rel3):
    """k rotated at positions 1..T, q at 0..T-1 (a cache's start position added to the keys alone): the scores are
    still a function of i - j, each one token off."""

    def key_positions(self, pos):
        return pos + 1


def GQAKeysOnePositionAhead(d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
    """The same with two query heads per key/value head."""
    return KeysOnePositionAhead(d_model, n_heads, d_ff, dropout, causal, n_kv_heads=max(1, n_heads // 2))


class PositionsFromOne(Rel3):
    """Correct: q and k both rotated at positions 1..T (one-based positions): the same scores as from 0."""

    def positions(self, pad_mask, B, T, device):
        return torch.arange(1, T + 1, device=device).expand(B, T)


class RoPEValuesSDPA(RoPEValues3):
    """Correct: RoPEValues3 through scaled_dot_product_attention (VO-RoPE), whose values the card captures: they
    differ by position, the weighted sum is rotated back."""

    def attend(self, q, k, v, allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


class ValuesRotatedSDPA(RoPEValuesSDPA):
    def unvalues(self, y, pos):
        return y  # bug: the rotary embedding applied to v as well (`q, k, v = map(rotate, ...)`), never undone
