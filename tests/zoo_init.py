"""Initialisations that training cannot leave, for `optimizer_step`'s stuck parameters: two factors of one product
zero-initialised together hold each other's gradient at exactly zero, at every step. And the correct twins that also
start with zero gradients but leave them after one step (a zero output projection, ReZero, LoRA, muP's zero query)
or whose zero gradient is the block's structure (a key bias). Each is `TrainBlock` of tests/zoo_training.py with its
initialisation changed; constructors take tblock's keywords."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


def zeroed(*modules):
    for m in modules:
        nn.init.zeros_(m.weight)


# ----------------------------------------------------------------------------- planted


class ZeroGatedFFN(TrainBlock):
    """The whole SwiGLU FFN zero-initialised (an init that meant to zero the down projection only): w1, w3 and w2
    each get their gradient through the others, all zero; the FFN stays 0 for ever."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        zeroed(self.w1, self.w3, self.w2)


class ZeroValueAndOutput(TrainBlock):
    """v_proj and o_proj both zero: the value path's gradient is o's transpose times the output's, o's is the values."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        zeroed(self.v_proj, self.o_proj)


class ZeroQueryAndKey(TrainBlock):
    """q_proj and k_proj both zero: attention uniform over the allowed keys for ever (q's gradient is k, k's is q)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        zeroed(self.q_proj, self.k_proj)


class ZeroGateZeroBranch(TrainBlock):
    """A ReZero gate at 0 in front of an FFN whose output projection is also 0: the gate's gradient is the branch's
    output (0), the projection's is scaled by the gate (0)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.alpha = nn.Parameter(torch.zeros(1))
        zeroed(self.w2)

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.alpha * self.ffn(self.ffn_norm(x))


# ----------------------------------------------------------------------------- correct twins


class ZeroOutputProjections(TrainBlock):
    """o_proj and w2 zero (GPT-NeoX/T-Fixup style): the branches start at 0, both projections get gradients."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        zeroed(self.o_proj, self.w2)


class ReZero(TrainBlock):
    """x + alpha * f(x), alpha = 0 (Bachlechner et al.): the branches' gradients are zero until alpha moves, and
    alpha's gradient is not."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.alpha_attn, self.alpha_ffn = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x):
        x = x + self.alpha_attn * self.drop(self.attention(self.attn_norm(x)))
        return x + self.alpha_ffn * self.ffn(self.ffn_norm(x))


class LoRAValue(TrainBlock):
    """A LoRA adapter on v_proj (B zero, A random): A's gradient is zero until B moves."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rank=4):
        super().__init__(d_model, n_heads, dropout, causal)
        self.lora_a = nn.Linear(d_model, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_model, bias=False)
        zeroed(self.lora_b)

    def attention(self, h):
        q, k = heads(self.q_proj(h), self.n_heads), heads(self.k_proj(h), self.n_heads)
        v = heads(self.v_proj(h) + self.lora_b(self.lora_a(h)), self.n_heads)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class ZeroQuery(TrainBlock):
    """muP's zero-initialised query projection: k's gradient is zero until q moves, q's is not."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        zeroed(self.q_proj)


class ZeroKeyBias(TrainBlock):
    """Biased q/k/v projections, the key bias zero: its gradient is zero whatever the weights (a softmax ignores a
    score added to a whole row), a structure no initialisation changes."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))
        nn.init.zeros_(self.k_proj.bias)


# ----------------------------------------------------------------------------- planted behind a zero init
# Bugs a zero init hides from every output comparison: at init the block is the identity on its stream, so without the
# battery's draw (checks/zeros.py) causal and batch compared x with x and passed.


class ZeroOutputLeaksFuture(ZeroOutputProjections):
    """Says it is causal (keeps causal=True) and attends to every key: the zero o_proj hid the future's leak."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v)))


class ReZeroMixesBatch(ReZero):
    """ReZero's gates at 0 in front of an attention whose keys are centred over the batch: samples leak into each
    other, hidden at init by the gate."""

    def attention(self, h):
        return super().attention(h - h.mean(0, keepdim=True))


BEHIND_ZEROS = {"ZeroOutputLeaksFuture": "causal", "ReZeroMixesBatch": "batch"}


PLANTED = {"ZeroGatedFFN": "optimizer_step", "ZeroValueAndOutput": "optimizer_step",
           "ZeroQueryAndKey": "optimizer_step", "ZeroGateZeroBranch": "optimizer_step"}
CORRECT = ["ZeroOutputProjections", "ReZero", "LoRAValue", "ZeroQuery", "ZeroKeyBias"]


class LoRAFrozenBase(LoRAValue):
    """LoRA as it is trained: every base parameter frozen, only the adapter's A and B train (frozen by design, not
    the slip of a norm weight left at requires_grad=False)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rank=4):
        super().__init__(d_model, n_heads, dropout, causal, rank)
        for name, p in self.named_parameters():
            p.requires_grad_(name.startswith("lora_"))


CORRECT.append("LoRAFrozenBase")


class FrozenRotaryTable(TrainBlock):
    """The rotary inv_freq kept as a frozen Parameter (requires_grad=False), as some repositories keep fixed tables:
    by design, not a weight frozen by mistake (no weight or bias, no sibling of its class trains it)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        table = self.rotary.inv_freq
        del self.rotary.inv_freq
        self.rotary.inv_freq = nn.Parameter(table.clone(), requires_grad=False)


CORRECT.append("FrozenRotaryTable")


class ConstantInitTypo(TrainBlock):
    """An init loop with nn.init.constant_(w, 0.02) where normal_(std=0.02) was meant: every FFN hidden unit (and
    every attention channel) the same, getting the same gradient at every step: one unit, trained d_ff times."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.constant_(m.weight, 0.02)


class UnitsTiled(TrainBlock):
    """The FFN's units drawn for a fifth of its width and tiled (rows of w1 and w3, columns of w2): five copies of
    each, which no step tells apart."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        hidden = self.w2.in_features
        k = -(-hidden // 5)
        with torch.no_grad():
            for lin in (self.w1, self.w3):
                lin.weight.copy_(lin.weight[:k].repeat(5, 1)[:hidden])
            self.w2.weight.copy_(self.w2.weight[:, :k].repeat(1, 5)[:, :hidden])


SYMMETRIC = {"ConstantInitTypo": 1, "UnitsTiled": None}  # distinct units: 1, or a fifth of the width


class AttentionConstantInit(TrainBlock):
    """The init typo on the attention's projections only: every channel of a head's values the same (equal value
    rows, equal output columns), one channel per head trained head_dim times."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.constant_(lin.weight, 0.02)


SYMMETRIC["AttentionConstantInit"] = "heads"  # one distinct channel per head
