"""Routing and widths a block states in its own words and computes otherwise: DeepSeek's group-limited routing
(n_group groups of experts, each token's experts among its topk_group best; DeepSeek-V2's greedy groups ranked by their
best expert, V3's by the sum of their two best sigmoid scores), T5's per-head width `d_kv`, Gemma's
`use_bidirectional_attention`, DINOv2's `use_swiglu_ffn`, Qwen2-MoE's `norm_topk_prob=False` and its shared expert's
sigmoid gate, and Mixtral's softmax router (its family's, no field says them): each planted bug beside a twin that does what it says."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from zoo_families import HalfRotary, PlainSiLUMLP
from zoo_training import TrainBlock


@dataclass
class GroupConfig:
    """DeepSeek-V2's routing fields: 8 experts in 4 groups of 2, each token's 2 experts from its best group."""

    model_type: str = "deepseek_v2"
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 1
    topk_method: str = "group_limited_greedy"
    scoring_func: str = "softmax"


class GroupLimited(TrainBlock):
    """Correct: DeepSeek-V2's group_limited_greedy router over a dense FFN's place, as its MoE gate computes it."""

    config_class = GroupConfig

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.config = self.config_class()
        n = self.config.num_experts if hasattr(self.config, "num_experts") else self.config.n_routed_experts
        self.gate = nn.Linear(d_model, n, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 32), nn.SiLU(), nn.Linear(32, d_model))
                                     for _ in range(n))

    def scores(self, h):
        return self.gate(h).softmax(-1)

    def group_mask(self, s):
        """(..., E) -> (..., E) True for the experts of each token's topk_group best groups (ranked by their best)."""
        c = self.config
        g = s.view(*s.shape[:-1], c.n_group, -1).max(-1).values
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(c.topk_group, -1).indices, True)
        return keep.unsqueeze(-1).expand(*g.shape, s.shape[-1] // c.n_group).reshape(s.shape)

    def weights(self, s, idx):
        return s.gather(-1, idx)

    def ffn(self, h):
        s = self.scores(h)
        idx = s.masked_fill(~self.group_mask(s), -math.inf).topk(self.config.num_experts_per_tok, -1).indices
        w = self.weights(s, idx)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return self.drop(out)


class GroupLimitIgnored(GroupLimited):
    """Keeps DeepSeek-V2's n_group 4, topk_group 1 and takes each token's plain top-2 over all experts."""

    def group_mask(self, s):
        return torch.ones_like(s, dtype=torch.bool)


class GroupsStrided(GroupLimited):
    """Groups the experts e % n_group (0, 4 | 1, 5 | ...) where DeepSeek's groups are contiguous (0, 1 | 2, 3 | ...)."""

    def group_mask(self, s):
        c = self.config
        g = s.view(*s.shape[:-1], -1, c.n_group).max(-2).values  # group j holds experts j, j + 4
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(c.topk_group, -1).indices, True)
        return keep.unsqueeze(-2).expand(*g.shape[:-1], s.shape[-1] // c.n_group, c.n_group).reshape(s.shape)


@dataclass
class V3Config(GroupConfig):
    """DeepSeek-V3's: sigmoid scores, groups ranked by their two best, the chosen renormalised and scaled by 2.5."""

    model_type: str = "deepseek_v3"
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5


class V3Grouped(GroupLimited):
    """Correct: DeepSeek-V3's router (its selection bias at 0, as built)."""

    config_class = V3Config

    def scores(self, h):
        return self.gate(h).sigmoid()

    def group_mask(self, s):
        c = self.config
        g = s.view(*s.shape[:-1], c.n_group, -1).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(c.topk_group, -1).indices, True)
        return keep.unsqueeze(-1).expand(*g.shape, s.shape[-1] // c.n_group).reshape(s.shape)

    def weights(self, s, idx):
        w = s.gather(-1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * self.config.routed_scaling_factor


@dataclass
class T5Config:
    model_type: str = "t5"
    d_kv: int = 32


class HeadWidthFromDKV(TrainBlock):
    """Correct: T5's per-head width d_kv (32) apart from the model's width over its heads (64 / 4 = 16): q, k and v
    project to heads x d_kv."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = T5Config()
        inner = n_heads * self.width(d_model, n_heads)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, inner, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.rotary = self.rotary_class(self.width(d_model, n_heads))

    def width(self, d_model, n_heads):
        return self.config.d_kv


class DKVIgnored(HeadWidthFromDKV):
    """Keeps d_kv 32 and splits the model's width over its heads."""

    def width(self, d_model, n_heads):
        return d_model // n_heads


@dataclass
class GemmaConfig:
    """EmbeddingGemma's switch, without its model_type (gemma3_text's family also claims (1 + w) norms on both sides of
    each sublayer and per-head q/k norms, which this small block leaves out)."""

    use_bidirectional_attention: bool = True


class Bidirectional(TrainBlock):
    """Correct: an embedding model's layer (EmbeddingGemma's) that says it attends both ways, and does: an encoder's
    constructor, no causal argument."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1):
        super().__init__(d_model, n_heads, dropout, causal=False)
        self.config = GemmaConfig()


class BidirectionalMaskedCausally(Bidirectional):
    """Says use_bidirectional_attention and keeps the decoder's causal mask."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.causal = True


@dataclass
class DinoConfig:
    model_type: str = "dinov2"
    use_swiglu_ffn: bool = True
    hidden_act: str = "silu"


class SwiGLUSaid(TrainBlock):
    """Correct: DINOv2's SwiGLU FFN switch, honoured (TrainBlock's FFN is SwiGLU)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.config = DinoConfig()


class SwiGLUSaidPlainMLP(PlainSiLUMLP, SwiGLUSaid):
    """Says use_swiglu_ffn and runs a plain SiLU MLP (the gate's matrix built and never called: w3 removed)."""


@dataclass
class Qwen2MoeConfig:
    model_type: str = "qwen2_moe"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = False


class Qwen2MoePort(GroupLimited):
    """Correct: Qwen2-MoE's router, a softmax over every expert and the chosen experts' probabilities as they are
    (its config's norm_topk_prob=False)."""

    rotary_class = HalfRotary  # transformers' layout, as the family's checkpoints pair the channels

    config_class = Qwen2MoeConfig

    def group_mask(self, s):
        return torch.ones_like(s, dtype=torch.bool)

    def ffn(self, h):
        s = self.scores(h)
        w, idx = self.chosen(self.gate(h), s)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return self.drop(out)

    def chosen(self, logits, s):
        w, idx = s.topk(self.config.num_experts_per_tok, -1)
        return w, idx


class Qwen2MoeMixtralRouted(Qwen2MoePort):
    """A Qwen2-MoE port routed as Mixtral is: the softmax taken over the chosen logits, renormalised, where its config
    says norm_topk_prob=False."""

    def chosen(self, logits, s):
        top, idx = logits.topk(self.config.num_experts_per_tok, -1)
        return top.softmax(-1), idx


@dataclass
class Qwen2MoeSharedConfig(Qwen2MoeConfig):
    shared_expert_intermediate_size: int = 32


class SharedMoe(nn.Module):
    """Qwen2-MoE's sparse MoE block as a module of its own: routed experts (a softmax over all, the chosen
    probabilities as they are) and a shared expert gated by a sigmoid of a one-output linear."""

    gated = True

    def __init__(self, d_model, config):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(d_model, config.num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 32), nn.SiLU(), nn.Linear(32, d_model))
                                     for _ in range(config.num_experts))
        self.shared_expert = nn.Sequential(nn.Linear(d_model, 32), nn.SiLU(), nn.Linear(32, d_model))
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, h):
        w, idx = self.gate(h).softmax(-1).topk(self.config.num_experts_per_tok, -1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (w * (idx == e)).sum(-1, keepdim=True) * expert(h)
        shared = self.shared_expert(h)
        return out + (torch.sigmoid(self.shared_expert_gate(h)) * shared if self.gated else shared)


class UngatedSharedMoe(SharedMoe):
    gated = False

    def __init__(self, d_model, config):
        super().__init__(d_model, config)
        del self.shared_expert_gate


class Qwen2MoeShared(TrainBlock):
    """Correct: Qwen2-MoE's layer, its shared expert gated by a sigmoid (`shared_expert_gate`)."""

    rotary_class = HalfRotary  # transformers' layout, as the family's checkpoints pair the channels

    moe_class = SharedMoe

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.config = Qwen2MoeSharedConfig()
        self.mlp = self.moe_class(d_model, self.config)

    def ffn(self, h):
        return self.drop(self.mlp(h))


class Qwen2MoeSharedUngated(Qwen2MoeShared):
    """Its shared expert added as DeepSeek's is, ungated (no gate built: only `spec` can tell)."""

    moe_class = UngatedSharedMoe


@dataclass
class MixtralConfig:
    model_type: str = "mixtral"
    num_experts: int = 8  # Mixtral's num_local_experts, named as the port's base class reads it
    num_experts_per_tok: int = 2


class MixtralPort(Qwen2MoePort):
    """Correct: Mixtral's router, a softmax over every expert, the chosen experts' probabilities renormalised (its
    config names no router: its family, `model_type` mixtral, says softmax)."""

    config_class = MixtralConfig

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        for expert in self.experts:  # Mixtral's experts add no bias
            expert[0].bias, expert[2].bias = None, None

    def chosen(self, logits, s):
        w, idx = s.topk(self.config.num_experts_per_tok, -1)
        return w / w.sum(-1, keepdim=True), idx


class MixtralWeightsSwapped(MixtralPort):
    """Each token's two chosen experts weighted by each other's probability (the order of the top-k lost): the
    weights are no function of the router's outputs."""

    def chosen(self, logits, s):
        w, idx = super().chosen(logits, s)
        return w.flip(-1), idx


PLANTED = {"GroupLimitIgnored": "moe.groups", "GroupsStrided": "moe.groups", "DKVIgnored": "attn.head_dim",
           "BidirectionalMaskedCausally": "attn.causal", "SwiGLUSaidPlainMLP": "ffn.gated",
           "Qwen2MoeMixtralRouted": "moe.renorm", "MixtralWeightsSwapped": "moe.router",
           "Qwen2MoeSharedUngated": "moe.shared_gate"}
CORRECT = ["GroupLimited", "V3Grouped", "HeadWidthFromDKV", "Bidirectional", "SwiGLUSaid", "Qwen2MoePort", "MixtralPort",
           "Qwen2MoeShared"]
# bidirectional: run without --causal in the sweeps
BIDIRECTIONAL = ["Bidirectional"]
