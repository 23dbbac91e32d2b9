"""Planted bugs the mixing checks catch: samples that leak into each other (batch), padding that reaches real outputs, a
future that reaches the past (causal), token order scrambled (order)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_correct import Good, LlamaBlock, OpaqueNames, XEncoder, allowed_mask, heads, merge


class PaddingIgnored(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, None)  # bug: accepts the mask, never passes it


class PaddingInverted(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, None if pad_mask is None else ~pad_mask)  # bug: True = keep


class BatchFirstMixup(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.attn.batch_first = False  # bug: attends across the batch axis

    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


class BatchMeanLeak(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + 0.1 * x.mean(0, keepdim=True)  # bug: a batch statistic


class BatchNormLeak(Good):
    """Leaks only in train mode (BatchNorm's batch statistics); eval uses running stats."""

    def __init__(self, d_model=64, *a, **k):
        super().__init__(d_model, *a, **k)
        self.bn = nn.BatchNorm1d(d_model)

    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)  # bug: normalises across the batch
        return x + self.ffn(h)


class NotCausal(Good):
    def mask(self, T, device):
        return None  # bug: claims causal, masks nothing


class CausalOffByOne(Good):
    def mask(self, T, device):
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(2)  # bug: sees t + 1


class HeadsNoTranspose(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))
        x = x + self.w_d(y.reshape(x.shape))  # bug: (B, nh, T, hs) reshaped without transposing back
        return x + self.g(F.gelu(self.f(self.n2(x))))


class HeadsNoTransposeNoMask(HeadsNoTranspose):
    def forward(self, x):
        return super().forward(x)


class TokenShift(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.gelu(self.f(self.n2(x).roll(1, dims=1))))  # bug: tokens shifted in the FFN path


class TokenShiftNoMask(TokenShift):
    def forward(self, x):
        return super().forward(x)


class MaskPolarityZeroRows(XEncoder):
    """Documents pad_mask as True = padding but reads it as True = keep, and zeroes 'masked' query rows."""

    def forward(self, x, pad_mask=None):
        keep = pad_mask  # bug: wrong polarity
        out = super().forward(x, keep)
        if keep is None:
            return out
        return x + (out - x) * keep[..., None]


class CausalIgnoresPadding(Good):
    """Causal, takes pad_mask, drops it: right padding cannot show it, left padding does."""

    def forward(self, x, pad_mask=None):
        return super().forward(x, None)  # bug


class PadMaskOnQueries(LlamaBlock):
    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        allowed = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[None, None] if self.causal else None
        if pad_mask is not None:
            rows = ~pad_mask[:, None, :, None]  # bug: masks query rows, not keys
            allowed = rows if allowed is None else allowed & rows
            allowed = allowed | ~rows.any(-2, keepdim=True)  # keep the row non-empty
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)))
