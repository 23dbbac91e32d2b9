"""Planted bugs the structure checks catch: an eval-only path (train_eval), a linear FFN or parameters outside
attention, FFN and norms (ffn_share), a norm missing or misplaced (norm_placement), names that contradict roles
(names); and bare parameters."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_correct import Good, LlamaBlock, OpaqueNames, allowed_mask, heads, merge
from zoo_positions import Rel3


class ExtraParams(Good):
    """Correct: a learned position table (512 x d) outside attention, FFN and norms: `ffn_share` says where those
    parameters are (the 2/3 rule no longer reads) and passes; a design, not a fault."""

    def __init__(self, d_model=64, *a, **k):
        super().__init__(d_model, *a, **k)
        self.pos = nn.Parameter(torch.randn(512, d_model) * 0.02)

    def forward(self, x, pad_mask=None):
        # positions counted from each sample's first real token, so left padding moves none
        pos = torch.arange(x.shape[1], device=x.device) if pad_mask is None else ((~pad_mask).long().cumsum(-1) - 1).clamp(min=0)
        return super().forward(x + self.pos[pos], pad_mask)


class EvalSkipsFFN(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        if not self.training:
            return x  # bug: the FFN only runs in training
        return x + self.ffn(self.ln2(x))


class LinearFFN(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.ffn[1] = nn.Identity()  # bug: no nonlinearity: the two Linears compose to one


class LinearFFNOpaque(OpaqueNames):
    def forward(self, x, pad_mask=None):
        h = self.n1(x)
        q, k, v = heads(self.w_a(h), self.n), heads(self.w_b(h), self.n), heads(self.w_c(h), self.n)
        x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, self.causal, pad_mask))))
        return x + self.g(F.dropout(self.f(self.n2(x)), 0.0, self.training))  # bug: dropout where the activation was


class NoNormBeforeFFN(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(x)  # bug: ln2 defined, never applied


class NoNormBeforeAttention(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(x, pad_mask)  # bug: ln1 skipped
        return x + self.ffn(self.ln2(x))


class PostThenPre(Good):
    """Post-LN around attention, Pre-LN around the FFN: the two placements mixed in one block."""

    def forward(self, x, pad_mask=None):
        x = self.ln1(x + self.sa(x, pad_mask))
        return x + self.ffn(self.ln2(x))


class NormOnQueriesOnly(Good):
    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = x + self.attn(h, x, x, key_padding_mask=pad_mask, attn_mask=self.mask(x.shape[1], x.device), need_weights=False)[0]  # bug
        return x + self.ffn(self.ln2(x))


class RawParams(nn.Module):
    """Pre-LN written with bare nn.Parameter matrices used as x @ W.T (no nn.Linear anywhere)."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None):
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.n = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.randn(d_model, d_model) / math.sqrt(d_model)) for _ in range(4))
        self.w_in = nn.Parameter(torch.randn(d_ff, d_model) / math.sqrt(d_model))
        self.w_out = nn.Parameter(torch.randn(d_model, d_ff) / math.sqrt(d_ff))

    def forward(self, x, pad_mask=None):
        h = self.norm1(x)
        q, k, v = (heads(h @ w.T, self.n) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(x.shape[1], x.device, False, pad_mask))
        x = x + merge(y) @ self.wo.T
        return x + F.gelu(self.norm2(x) @ self.w_in.T) @ self.w_out.T


class ActOnUp(Rel3):
    def ffn(self, h):
        return self.down_proj(self.gate_proj(h) * F.silu(self.up_proj(h)))  # bug: the activation on up_proj


class ActAfterProduct(Rel3):
    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h) * self.up_proj(h)))  # bug: act(gate * up), not act(gate) * up


class SublayerPostNorm(LlamaBlock):
    """Correct: OLMo-2's placement, each sublayer reading the stream as it is and its output normalised before the
    residual add (x = x + norm(attn(x)); x = x + norm(ffn(x)))."""

    def forward(self, x, pad_mask=None):
        x = x + self.attn_norm(self.attention(x, pad_mask))
        return x + self.ffn_norm(self.down(F.silu(self.gate(x)) * self.up(x)))


class SublayerPostNormMixed(LlamaBlock):
    """OLMo-2's placement for the attention, Pre-LN for the FFN: two placements in one block."""

    def forward(self, x, pad_mask=None):
        x = x + self.attn_norm(self.attention(x, pad_mask))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))  # bug: the FFN reads a normalised stream, the attention does not
