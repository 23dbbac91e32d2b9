"""Planted bugs the attention check catches: the softmax over the wrong axis, scores unscaled or scaled twice, a masked
diagonal, no softmax at all, a bias added to the probabilities; and an attention-only block, and a relative bias
added where it belongs (the last one's twin)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_correct import HandSoftmax, LlamaBlock, OpaqueNames, QKNorm, allowed_mask, heads, merge


class SoftmaxOverQueries(LlamaBlock):
    """Attention normalised over the query axis: each key's weights sum to 1, so the future leaks."""

    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.n_heads)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
        w = scores.softmax(dim=-2).nan_to_num(0.0)  # bug: softmax over queries, not keys
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, T, C))


class AttentionOnly(nn.Module):
    """A residual attention layer and no FFN: params must omit the FFN share, with a note."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        h = self.norm(x)
        return x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]


class Unscaled(HandSoftmax):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1)  # bug: no 1/sqrt(d_head)


class UnscaledSDPA(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask), scale=1.0)  # bug
        x = x + self.w_d(merge(y))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class UnscaledQKNorm(QKNorm):
    def attention(self, h, pad_mask):
        B, T, C = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        s = (q @ k.transpose(-2, -1)).masked_fill(~allowed_mask(T, h.device, self.causal, pad_mask), float("-inf"))  # bug: no scale
        return self.o_proj(merge(s.softmax(-1) @ v))


class SoftmaxQueryAxisBidirectional(HandSoftmax):
    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        return merge(s.softmax(dim=-2).nan_to_num(0.0) @ v)  # bug: normalised over the queries


class SoftmaxHeadAxisBidirectional(HandSoftmax):
    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        return merge(s.softmax(dim=1).nan_to_num(0.0) @ v)  # bug: normalised over the heads


class DiagonalMasked(HandSoftmax):
    """Causal mask from triu(0): no token sees itself; the first row is empty and zeroed."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        s = self.scores(q, k).masked_fill(torch.ones(T, T, dtype=torch.bool, device=h.device).triu(0), float("-inf"))  # bug
        return merge(s.softmax(dim=-1).nan_to_num(0.0) @ v)


class DiagonalMaskedFirstOpen(HandSoftmax):
    """Causal mask from triu(0), the first query's own score reopened so its row is not empty: no other token sees
    itself, and nothing is NaN."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        blocked = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(0)  # bug: the diagonal too
        blocked[0, 0] = False
        return merge(self.scores(q, k).masked_fill(blocked, float("-inf")).softmax(dim=-1) @ v)


class SoftmaxTwice(HandSoftmax):
    """The probabilities put through a softmax again (a helper that normalises what it is handed): still a distribution
    in the first one's order, flattened to ~1/keys."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        allowed = allowed_mask(h.shape[1], h.device, self.causal, mask)
        p = self.scores(q, k).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return merge(p.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v)  # bug: a second softmax


class BandRenormalised(HandSoftmax):
    """The softmax's weights kept within 4 positions of each query and renormalised (a local window applied after the
    softmax): the kept log-differences are the softmax's, so the weights are not reweighted (twin of SoftmaxTwice).
    A band, not a top-k: a top-k over the near-tied keys of an untrained block picks other keys in half precision."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        allowed = allowed_mask(T, h.device, self.causal, mask)
        p = self.scores(q, k).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        i = torch.arange(T, device=h.device)
        kept = p.float() * ((i[:, None] - i[None, :]).abs() <= 4)  # float32: a half sum would underflow to 0
        return merge((kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)).to(v.dtype) @ v)  # a padding row stays 0


class ScaledByDModel(HandSoftmax):
    def scores(self, q, k):
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1] * self.n)  # bug: 1/sqrt(d_model), not 1/sqrt(d_head)


class ScaledTwice(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        q = q / math.sqrt(q.shape[-1])  # bug: SDPA scales by 1/sqrt(d_head) again
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.gelu(self.f(self.n2(x))))


class ManualSoftmax(HandSoftmax):
    """Correct: softmax written out as exp / sum (with the max subtracted), not torch.softmax."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return merge((e / e.sum(-1, keepdim=True)) @ v)


class NoSoftmax(HandSoftmax):
    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), 0.0)
        return merge(s @ v)  # bug: the scores weight the values with no softmax


class RelativeBiasBeforeSoftmax(HandSoftmax):
    """Correct: a learned relative position bias (one per head and offset, Swin's) added to the scores."""

    max_len = 64

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=False):
        super().__init__(d_model, n_heads, d_ff, causal)
        self.rel = nn.Parameter(torch.randn(n_heads, 2 * self.max_len - 1) * 0.02)

    def bias(self, T, device):
        i = torch.arange(T, device=device)
        return self.rel[:, i[None, :] - i[:, None] + self.max_len - 1]

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        s = self.scores(q, k) + self.bias(T, h.device)
        return merge(s.masked_fill(~allowed_mask(T, h.device, self.causal, mask), float("-inf")).softmax(dim=-1) @ v)


class RelativeBiasOnProbabilities(RelativeBiasBeforeSoftmax):
    """The bias added to the probabilities after the softmax: rows no longer sum to 1 (0.85 to 1.17 at init)."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        T = h.shape[1]
        s = self.scores(q, k).masked_fill(~allowed_mask(T, h.device, self.causal, mask), float("-inf"))
        return merge((s.softmax(dim=-1) + self.bias(T, h.device)) @ v)


class TopKAttention(HandSoftmax):
    """Sparse top-k attention (each query keeps its 4 largest weights, renormalised; x-transformers'
    attn_sparse_topk), its scores at a tenth of the usual scale: on an untrained block the keys are near-tied, so
    bfloat16's rounding of the scores picks other keys for a quarter of the queries or more, anywhere along the
    sequence. A correct design whose precision is not judged (`precision.jumps`); half-precision runs flip its
    selections as well (its prefix run alone is judged on a float64 copy there), and its scores' tenth of the scale is
    warned by `attention`, so it is not in the false-alarm sweep."""

    def scores(self, q, k):
        return super().scores(q, k) / 10

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        allowed = allowed_mask(h.shape[1], h.device, self.causal, mask)
        p = self.scores(q, k).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        top = p.topk(min(4, p.shape[-1]), dim=-1)
        kept = torch.zeros_like(p).scatter(-1, top.indices, top.values)
        return merge(kept / kept.sum(-1, keepdim=True) @ v)


class QuietSoftmax(HandSoftmax):
    """Correct: quiet attention (softmax1: exp(s) / (1 + sum exp(s)), a sink of logit 0 in every row), written out
    and stabilised by the row's maximum: its weights sum below 1, and log w is still the logits up to each row's
    constant."""

    def attend(self, h, mask):
        q, k, v = (heads(t, self.n) for t in self.qkv(h).chunk(3, dim=-1))
        s = self.scores(q, k).masked_fill(~allowed_mask(h.shape[1], h.device, self.causal, mask), float("-inf"))
        m = s.amax(-1, keepdim=True).clamp_min(0)
        e = (s - m).exp()
        return merge(e / ((-m).exp() + e.sum(-1, keepdim=True)) @ v)


CORRECT = ["QuietSoftmax"]
