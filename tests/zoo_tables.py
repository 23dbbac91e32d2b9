"""Layouts built for one convention and read with another: a rotary table (what `spec` reads of the frequency each
pair turns at, held against the base the rotary module says it has) and grouped key/value heads (which key and which
value head each query head reads, held against the key/value head count the block takes); a soft-cap written as
cap * tanh(s) where Gemma-2's cap * tanh(s / cap) was meant; Mixtral's renormalisation over Switch's single expert;
a tanh GELU written out with a constant mistyped, held against the activation the block names; switches and counts a
block keeps (num_experts, a shared expert's width, qk_norm, norm_first, use_rope) that its computation does not
honour."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_claims import GroupedQuery
from zoo_training import MoEBlock, RMSNorm, Rotary, TrainBlock, attend, heads, merge


class CatTableRotary(Rotary):
    """HF's (T, dim) table, cat(freqs, freqs) for rotate_half, read with Meta's interleaved pairs at its even columns:
    pair i turns at frequency 2i mod dim/2, so half the frequencies turn twice and the slow half never."""

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(t.dtype)[..., 0::2], emb.sin().to(t.dtype)[..., 0::2]
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class CatTableInterleaved(TrainBlock):
    """The table above in a block whose rotary module says base 1e4 (its `base`): the twin is TrainBlock itself."""

    rotary_class = CatTableRotary


class ValuesTiledApart(GroupedQuery):
    """Grouped-query attention (num_key_value_heads 2 of 4) whose keys are repeat_interleaved (query heads 0, 1 read
    key head 0) and whose values are repeated (query heads 0, 2 read value head 0): every query head reads a key and a
    value of different kv heads, four (key, value) pairs where the block keeps two. Twin: zoo_claims' GroupedQuery."""

    def tiled(self, k, v, group):
        return k.repeat_interleave(group, 1), v.repeat(1, group, 1, 1)


class GroupsStrided(GroupedQuery):
    """num_key_value_heads 2 of 4 with keys and values repeated whole (`k.repeat(1, group, 1, 1)`): query heads 0 and 2
    read kv head 0, where grouped-query attention's layout (repeat_kv, sdpa's enable_gqa) has 0 and 1 read it. It trains,
    and reads every grouped checkpoint wrong. Twin: zoo_claims' GroupedQuery."""

    def tiled(self, k, v, group):
        return k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)


class HeadDimIgnored(TrainBlock):
    """Built with head_dim 32 apart from d_model / n_heads = 16 (Gemma's 256 beside 3072 / 16, Qwen3's 128 beside 2560 /
    32) and keeping it, its heads split d_model / n_heads: a port's projections of the wrong width. Twin:
    HeadDimHonoured."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, head_dim=32):
        super().__init__(d_model, n_heads, dropout, causal)
        self.head_dim = head_dim


class HeadDimHonoured(HeadDimIgnored):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, head_dim=32):
        super().__init__(d_model, n_heads, dropout, causal, head_dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, n_heads * head_dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.rotary = Rotary(head_dim)


class Llama3Rotary(Rotary):
    """Llama 3.1's scaled table (transformers' _compute_llama3_parameters), from `orig` as the original length."""

    def __init__(self, dim, base, factor, low, high, orig):
        self.factor, self.low, self.high, self.orig = factor, low, high, orig
        super().__init__(dim, base)

    def frequencies(self, device=None):
        inv = super().frequencies(device)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > self.orig / self.low, inv / self.factor, inv)
        smooth = (self.orig / wavelen - self.low) / (self.high - self.low)
        medium = (wavelen >= self.orig / self.high) & (wavelen <= self.orig / self.low)
        return torch.where(medium, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)


class Llama3Scaled(TrainBlock):
    """Heads of 64 (three pairs in the band), theta 5e5 and Llama 3.1's rope_scaling, kept and applied."""

    LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    used_orig = 8192

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=500000.0, rope_scaling=None):
        super().__init__(d_model, n_heads, dropout, causal)
        self.rope_scaling, self.head_dim = rope_scaling or dict(self.LLAMA3), 64
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, n_heads * 64, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(n_heads * 64, d_model, bias=False)
        r = self.rope_scaling
        self.rotary = Llama3Rotary(64, rope_theta, r["factor"], r["low_freq_factor"], r["high_freq_factor"], self.used_orig)


class Llama3OriginalFromMax(Llama3Scaled):
    """The same config, the table built from max_position_embeddings (131072) where the original length (8192) is
    meant: factor and theta as claimed, the band 16x longer. Twin: Llama3Scaled."""

    used_orig = 131072


class Llama3BandSwapped(Llama3Scaled):
    """Heads of 16 (one pair inside the band: no ramp the card can read) and the band's ends swapped in the code
    (orig / high_freq_factor taken for the long end): no pair is smoothed, the band's pair is divided by the whole
    factor. Twin: Llama3NarrowHeads."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, rope_theta=10000.0):
        TrainBlock.__init__(self, d_model, n_heads, dropout, causal)
        self.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256}
        self.head_dim = 16
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, n_heads * 16, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(n_heads * 16, d_model, bias=False)
        low, high = self.ends()
        self.rotary = Llama3Rotary(16, rope_theta, 8.0, low, high, 256)

    def ends(self):
        return 4.0, 1.0


class Llama3NarrowHeads(Llama3BandSwapped):
    def ends(self):
        return 1.0, 4.0


class SoftcapNotDivided(TrainBlock):
    """Keeps `softcap` 20 and computes cap * tanh(q.k / sqrt(d_head)): bounded at the cap, as claimed, but its slope
    at small logits is the cap's, 20x the scale. Twin: zoo_claims' SoftcapApplied (cap * tanh(s / cap))."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, softcap=20.0):
        super().__init__(d_model, n_heads, dropout, causal)
        self.softcap = softcap

    def attention(self, h):
        d_head = self.q_proj.out_features // self.n_heads
        return attend(self, h, scale=self.softcap / math.sqrt(d_head), cap=self.softcap)


class SoftcapUnscaled(SoftcapNotDivided):
    """Keeps `softcap` 20 and computes cap * tanh(q.k / cap), the 1/sqrt(d_head) left out: a slope sqrt(d_head) times
    the convention's, not the cap's: warned as any unscaled block is, not failed."""

    def attention(self, h):
        return attend(self, h, scale=1.0, cap=self.softcap)


class OneExpertRouted(MoEBlock):
    """Switch routing, one expert per token, its config kept (`num_experts_per_tok`, `norm_topk_prob`): the gate is the
    router's probability, or with `norm_topk_prob` that probability over itself, 1 whatever the router computes."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, norm_topk_prob=False):
        super().__init__(d_model, n_heads, dropout, causal)
        self.num_experts_per_tok, self.norm_topk_prob = 1, norm_topk_prob

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        top, idx = probs.max(-1, keepdim=True)
        top = top / top.sum(-1, keepdim=True) if self.norm_topk_prob else top
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + top * (idx == e) * expert(h)
        return self.drop(out)


class OneExpertRenormalised(OneExpertRouted):
    """norm_topk_prob with one expert per token: every gate p / p = 1, so the router gets no gradient from the output."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal, norm_topk_prob=True)


class ExpertsCounted(MoEBlock):
    """Qwen-MoE's and OLMoE's `num_experts` kept as the block's own: 4, as many as it routes over (twin)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, num_experts=4):
        super().__init__(d_model, n_heads, dropout, causal)
        self.num_experts = num_experts


class ExpertsMiscounted(ExpertsCounted):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal, num_experts=8)  # bug: says 8, builds and routes over 4


class SparseMoeWithShared(nn.Module):
    """Qwen2-MoE's mixture as a module of its own: top-2 of 4 routed experts (softmax, not renormalised) plus a shared
    expert every token goes through, its width kept as `shared_expert_intermediate_size`."""

    def __init__(self, d, added=True):
        super().__init__()
        self.added, self.shared_expert_intermediate_size = added, 2 * d
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(4))
        self.shared_expert = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h):
        top, idx = self.gate(h).softmax(-1).topk(2, dim=-1)
        out = sum((top * (idx == e)).sum(-1, keepdim=True) * expert(h) for e, expert in enumerate(self.experts))
        return out + self.shared_expert(h) if self.added else out


class SharedExpertAdded(TrainBlock):
    """A block whose FFN is that mixture (twin)."""

    added = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.mlp = SparseMoeWithShared(d_model, self.added)

    def ffn(self, h):
        return self.drop(self.mlp(h))


class SharedExpertDropped(SharedExpertAdded):
    added = False  # bug: the shared expert built and kept, never added: no token goes through it


class QKNormApplied(TrainBlock):
    """Built with `qk_norm=True` (Llama 4's use_qk_norm, StableLM's qk_layernorm): per-head RMSNorms on q and k (twin)."""

    applied = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, qk_norm=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.qk_norm = qk_norm
        self.q_norm, self.k_norm = RMSNorm(d_model // n_heads), RMSNorm(d_model // n_heads)

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm and self.applied:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class QKNormBuiltNotApplied(QKNormApplied):
    applied = False  # bug: the norms are built and kept, the switch is on, and attention never calls them


class NormFirstHonoured(TrainBlock):
    """Built with torch's `norm_first` switch: True normalises each sublayer's input (Pre-LN), False the sum (twin)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, norm_first=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.pre = norm_first

    def forward(self, x):
        if self.pre:
            return super().forward(x)
        x = self.attn_norm(x + self.drop(self.attention(x)))
        return self.ffn_norm(x + self.ffn(x))


class NormFirstIgnored(NormFirstHonoured):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, norm_first=True):
        super().__init__(d_model, n_heads, dropout, causal, norm_first)
        self.pre = False  # bug: the switch taken and overridden: Post-LN whatever the caller asked


class RopeSwitchOn(TrainBlock):
    """A `use_rope=True` switch kept (SmolLM3's and Llama 4's per-layer switch), honoured: q and k rotate (twin)."""

    rotates = True

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, use_rope=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.use_rope = use_rope

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.use_rope and self.rotates:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class RopeSwitchIgnored(RopeSwitchOn):
    rotates = False  # bug: the switch on, the rotary module built, and no rotation reaches the scores


# block -> the entry spec names where it contradicts what the block says of itself
class TanhGeluWritten(TrainBlock):
    """GPT-2's tanh GELU written out, the block keeping the name it says (`activation = "gelu_new"`): twin."""

    c = 0.044715

    def __init__(self, d_model=64, n_heads=4, dropout=0.0, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.activation = "gelu_new"
        del self.w3  # no gate

    def ffn(self, h):
        u = self.w1(h)
        return self.drop(self.w2(0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + self.c * u ** 3)))))


class TanhGeluTypo(TanhGeluWritten):
    c = 0.44715  # bug: the cubic term's constant ten times too large: a curve close to GELU's, not GELU


@dataclass
class GraniteArgs:
    """Granite's muP multipliers, as its config keeps them (residual_multiplier 0.22 in Granite-3.0-8B's)."""
    d_model: int = 64
    n_heads: int = 4
    residual_multiplier: float = 0.22
    attention_multiplier: float | None = None  # None: 1 / d_head, Granite's muP score scale


class GraniteMultipliers(TrainBlock):
    """Each sublayer's output scaled by `residual_multiplier` at its add, scores by `attention_multiplier`: twin."""

    def __init__(self, config: GraniteArgs):
        super().__init__(config.d_model, config.n_heads, 0.0, True)
        if config.attention_multiplier is None:
            config.attention_multiplier = config.n_heads / config.d_model
        self.config = config

    def attention(self, h):
        return attend(self, h, scale=self.config.attention_multiplier)

    def forward(self, x):
        m = self.config.residual_multiplier
        x = x + m * self.drop(self.attention(self.attn_norm(x)))
        return x + m * self.ffn(self.ffn_norm(x))


class ResidualMultiplierDropped(GraniteMultipliers):
    """A port that keeps the config and adds each sublayer's output unscaled (llama's forward)."""

    def forward(self, x):
        return TrainBlock.forward(self, x)


class AttentionMultiplierDropped(GraniteMultipliers):
    """A port that keeps the config and scales scores by llama's 1/sqrt(d_head)."""

    def attention(self, h):
        return attend(self, h)


class TopTwoRenormalised(MoEBlock):
    """Qwen3-MoE's routing as its config says (num_experts_per_tok 2, norm_topk_prob): the top two probabilities over
    their sum. Twin of ProbabilitiesSoftmaxed."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, norm_topk_prob=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.num_experts_per_tok, self.norm_topk_prob = 2, norm_topk_prob

    def gates(self, top):
        return top / top.sum(-1, keepdim=True)

    def ffn(self, h):
        top, idx = self.router(h).softmax(-1).topk(2, dim=-1)
        top = self.gates(top)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (top * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return self.drop(out)


class ProbabilitiesSoftmaxed(TopTwoRenormalised):
    """The chosen probabilities put through a softmax again (softmax where a division was meant): the weights sum to 1,
    and are no softmax or sigmoid of the router's outputs, renormalised or not."""

    def gates(self, top):
        return top.softmax(-1)


PLANTED = {"CatTableInterleaved": "rope.theta", "ProbabilitiesSoftmaxed": "moe.renorm", "ValuesTiledApart": "attn.group", "TanhGeluTypo": "ffn.act",
           "ExpertsMiscounted": "moe.experts", "QKNormBuiltNotApplied": "attn.qk_norm",
           "SharedExpertDropped": "moe.shared", "NormFirstIgnored": "norm.placement",
           "RopeSwitchIgnored": "pos.kind", "ResidualMultiplierDropped": ("residual.attn_gain", "residual.ffn_gain"),
           "AttentionMultiplierDropped": "attn.scale", "GroupsStrided": "attn.kv_grouping",
           "HeadDimIgnored": "attn.head_dim", "Llama3OriginalFromMax": ("rope.low_freq_wavelen", "rope.high_freq_wavelen"),
           "Llama3BandSwapped": ("rope.low_freq_wavelen", "rope.high_freq_wavelen")}
WARNED = {"SoftcapUnscaled": "spec", "OneExpertRenormalised": "spec"}
# failed by a finding of its own (spec.cap_not_divided), not by an entry that differs
FAILED = {"SoftcapNotDivided": "spec"}
CORRECT = ["OneExpertRouted", "TanhGeluWritten", "ExpertsCounted", "QKNormApplied", "SharedExpertAdded",
           "NormFirstHonoured", "RopeSwitchOn", "GraniteMultipliers", "HeadDimHonoured",
           "Llama3Scaled", "Llama3NarrowHeads", "TopTwoRenormalised"]
