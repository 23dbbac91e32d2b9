"""Past one device (check --tp / --fsdp): a tensor-parallel-ready Llama layer and the ways sharding it breaks."""

import torch.nn as nn
import torch.nn.functional as F
from zoo_correct import RMSNorm, allowed_mask

# Under tensor parallelism q/k/v and the FFN's first projections are column-sharded: each rank sees a slice
# of their output features. A block is TP-ready when nothing between them and the row-sharded output
# projections needs the full width: heads split as view(B, T, -1, head_dim), not with the global head count.


class LlamaTP(nn.Module):
    """Correct and TP-ready: Llama-style, separate q/k/v/o, SwiGLU, heads split by head_dim (the width each rank has)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__()
        self.head_dim, self.causal = d_model // n_heads, causal
        hidden = int(8 * d_model / 3) // 32 * 32  # 160 at d_model 64: divisible by the ranks
        self.attn_norm, self.ffn_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def split(self, t):  # (B, T, local width) -> (B, local heads, T, hs)
        B, T, _ = t.shape
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    def qk(self, h):
        return self.split(self.q_proj(h)), self.split(self.k_proj(h))

    def attention(self, h, pad_mask):
        q, k = self.qk(h)
        v = self.split(self.v_proj(h))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(h.shape[1], h.device, self.causal, pad_mask))
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + self.ffn(self.ffn_norm(x))


class GlobalHeads(LlamaTP):
    """Correct on one device; under --tp each rank splits its slice into n_heads narrower heads (0.09 off, silently)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.n_heads = n_heads

    def split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.n_heads, -1).transpose(1, 2)  # bug under TP: the global head count


class FullWidthQKNorm(LlamaTP):
    """OLMo-2-style QK-norm over the full q/k width, written as a functional RMS norm: correct on one device;
    under --tp each rank normalises its own slice of q and k."""

    def qk(self, h):
        q, k = self.q_proj(h), self.k_proj(h)
        q, k = (F.rms_norm(t, t.shape[-1:], eps=1e-6) for t in (q, k))  # bug under TP: the slice's RMS, not q's
        return self.split(q), self.split(k)


class FullWidthQKNormWeighted(LlamaTP):
    """OLMo-2's QK-norm as it is written there: an RMSNorm module of width d_model on q and k. Correct on one
    device; under --tp its d_model weight meets each rank's d_model / N slice."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.q_norm, self.k_norm = RMSNorm(d_model), RMSNorm(d_model)

    def qk(self, h):
        return self.split(self.q_norm(self.q_proj(h))), self.split(self.k_norm(self.k_proj(h)))


class HiddenNormFFN(LlamaTP):
    """NormFormer-style norm over the FFN's hidden units, written functionally: correct on one device; under --tp
    the hidden units are column-sharded and each rank normalises its share."""

    def ffn(self, h):
        a = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return self.down_proj(F.layer_norm(a, a.shape[-1:]))  # bug under TP: the norm needs every hidden unit


class FusedQKV(LlamaTP):
    """Correct, one device and FSDP; --tp refuses it: q, k and v in one Linear (GPT-2's c_attn)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)

    def attention(self, h, pad_mask):
        q, k, v = (self.split(t) for t in self.qkv(h).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_mask(h.shape[1], h.device, self.causal, pad_mask))
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class CapturedWeight(LlamaTP):
    """Correct on one device; under FSDP the up projection's weight, kept in a plain list at construction, is the
    original tensor FSDP replaced: it gets no sharded gradient."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.kept = [self.up_proj.weight]  # bug under FSDP: a reference FSDP does not know about

    def ffn(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * F.linear(h, self.kept[0]))
