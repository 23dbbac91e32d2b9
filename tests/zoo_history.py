"""Blocks whose output depends, or must not depend, on the calls before it, for the `history` check. The plants keep
something from an earlier call outside their buffers and read it later: a padding bias cached by shape (another
mask at that shape reuses it), a rotary table built at the first call's length and padded for longer ones, a scale
taken from the first batch. The twins cache correctly: a table that grows and is sliced (in buffers), a mask cache
keyed by the mask itself. Each is `TrainBlock` of
tests/zoo_training.py with one method changed; constructors take tblock's keywords."""

import torch
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


class _Attend(TrainBlock):
    """TrainBlock whose attention takes a padding mask and an optional (cos, sin) table of its own."""

    def table(self, T, device):
        return None

    def attention(self, h, pad_mask=None):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        got = self.table(h.shape[1], h.device)
        if got is None:
            q, k = self.rotary(q), self.rotary(k)
        else:
            cos, sin = (t.to(q.dtype) for t in got)
            q, k = (torch.cat([t[..., ::2] * cos - t[..., 1::2] * sin, t[..., ::2] * sin + t[..., 1::2] * cos], -1)
                    for t in (q, k))
        T = h.shape[1]
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        bias = self.pad_bias(pad_mask, h) if pad_mask is not None else None
        mask = allowed if bias is None else allowed & bias
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))

    def pad_bias(self, pad_mask, h):
        return ~pad_mask[:, None, None, :]

    def forward(self, x, pad_mask=None):
        x = x + self.drop(self.attention(self.attn_norm(x), pad_mask))
        return x + self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------- planted


class PadMaskCachedByShape(_Attend):
    """The key-padding mask built once per (batch, length) and reused: a later batch of that shape with other
    padding (or none) attends with the first one's."""

    def pad_bias(self, pad_mask, h):
        shape = tuple(pad_mask.shape)
        if getattr(self, "_cached_shape", None) != shape:
            self._cached, self._cached_shape = ~pad_mask[:, None, None, :], shape
        return self._cached

    def forward(self, x, pad_mask=None):
        if pad_mask is None:
            pad_mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        return super().forward(x, pad_mask)


class TableOfFirstLength(_Attend):
    """cos/sin built at the first call's length and, for a longer call, padded with the identity rotation instead of
    being rebuilt: positions past the first length all read as position 0."""

    def table(self, T, device):
        if getattr(self, "_table", None) is None:
            f = self.rotary.angles(T, device)
            self._table = (f.cos(), f.sin())
        cos, sin = self._table
        if cos.shape[0] < T:
            n = T - cos.shape[0]
            cos, sin = F.pad(cos, (0, 0, 0, n), value=1.0), F.pad(sin, (0, 0, 0, n))
        return cos[:T], sin[:T]


class FirstBatchScale(TrainBlock):
    """The residual branch scaled by 1 / the rms of the first batch it saw (a plain attribute, meant to be a fixed
    init-time constant): each instance computes another function, fixed by what it happened to see first."""

    def forward(self, x):
        if getattr(self, "_scale", None) is None:
            self._scale = x.detach().pow(2).mean().rsqrt()
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self._scale * self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------- correct twins


class GrowingTable(_Attend):
    """cos/sin cached in non-persistent buffers, rebuilt for a longer call, sliced for shorter ones (transformers'
    older rotary cache; copies outside inference mode, so a table built in a validation pass can train)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("cos_cached", torch.ones(0, d_model // n_heads // 2), persistent=False)
        self.register_buffer("sin_cached", torch.zeros(0, d_model // n_heads // 2), persistent=False)

    def reset_parameters(self):
        self.cos_cached, self.sin_cached = self.cos_cached[:0], self.sin_cached[:0]

    def table(self, T, device):
        if self.cos_cached.shape[0] < T:
            f = self.rotary.angles(T, device)
            self.cos_cached, self.sin_cached = f.cos(), f.sin()
        return self.cos_cached[:T].clone(), self.sin_cached[:T].clone()


class PadMaskCachedByValue(_Attend):
    """The padding mask's bias cached, and rebuilt whenever the mask is another one."""

    def pad_bias(self, pad_mask, h):
        if getattr(self, "_key", None) is None or not torch.equal(self._key, pad_mask):
            self._key, self._cached = pad_mask.clone(), ~pad_mask[:, None, None, :]
        return self._cached


class FusedInEval(TrainBlock):
    """Eval fuses q, k and v into one matrix product, the weights concatenated at every call."""

    def fused(self) -> torch.Tensor:
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def attention(self, h):
        if self.training:
            return super().attention(h)
        q, k, v = (heads(t, self.n_heads) for t in F.linear(h, self.fused()).chunk(3, -1))
        q, k = self.rotary(q), self.rotary(k)
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))


class FusedKeptForInference(FusedInEval):
    """The fused matrix kept from the first call without gradients (validation, generation) for every later one: after
    an optimizer step those run the old q, k, v. A call with gradients builds it afresh, so gradients stay right."""

    def fused(self) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().fused()
        if getattr(self, "_kept", None) is None:
            self._kept = super().fused().clone()
        return self._kept


PLANTED = {"PadMaskCachedByShape": "history", "TableOfFirstLength": "history", "FirstBatchScale": "history",
           "FusedKeptForInference": "optimizer_step"}
CORRECT = ["GrowingTable", "PadMaskCachedByValue"]
CORRECT_STEP = ["FusedInEval"]  # no padding mask: the history check's padded probe skips it
