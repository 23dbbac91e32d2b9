"""Construction slips Python makes easy: a list multiplied where a comprehension was meant (`[Head()] * n` is one
head n times), an init that assigns new Parameters where it should fill them, a `causal` argument never wired to the
attention, a count kept in the forward that activation checkpointing's recompute runs again, a module every instance
shares (a default argument, a module-level cache), weights drawn from NumPy's or Python's stream or after a reseed
from the clock (no torch seed reproduces them). Each with its twin.
nanoGPT-lecture style blocks: a ModuleList of single-head attentions, a LayerNorm before each sublayer, a ReLU FFN."""

import random

import numpy as np
import torch
import torch.nn as nn
from zoo_training import MoEBlock, RMSNorm, TrainBlock, attend


class Head(nn.Module):
    def __init__(self, d_model, head_size, dropout):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(d_model, head_size, bias=False) for _ in range(3))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        T = x.shape[1]
        k, q, v = self.key(x), self.query(x), self.value(x)
        w = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5
        w = w.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        return self.dropout(w.softmax(-1)) @ v


class HeadsBuilt(nn.Module):
    """n Head modules, each its own."""

    def __init__(self, d_model=64, n_heads=4, d_ff=256, dropout=0.1):
        super().__init__()
        self.heads = self.make_heads(d_model, n_heads, dropout)
        self.proj = nn.Linear(d_model, d_model)
        self.ffwd = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout))
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def make_heads(self, d, n, p):
        return nn.ModuleList([Head(d, d // n, p) for _ in range(n)])

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.drop(self.proj(torch.cat([head(h) for head in self.heads], -1)))
        return x + self.ffwd(self.ln2(x))


class HeadsListMultiplied(HeadsBuilt):
    """nn.ModuleList([Head(...)] * n_heads): one Head object at n entries, so every head is the same head (and the
    block has a quarter of the attention parameters it should)."""

    def make_heads(self, d, n, p):
        return nn.ModuleList([Head(d, d // n, p)] * n)


class ReplacingRMSNorm(RMSNorm):
    """reset_parameters assigns a new Parameter: made on the default device whatever to_empty chose, and an optimizer,
    a tie or fully_shard's DTensor made before keep the old one."""

    def reset_parameters(self):
        self.weight = nn.Parameter(torch.ones(self.weight.shape[0]))


class NormReplacedAtInit(TrainBlock):
    """TrainBlock whose norms' init assigns new Parameters. Twin: TrainBlock (RMSNorm.reset_parameters fills in place)."""

    norm_class = ReplacingRMSNorm


class CausalArgumentHonoured(TrainBlock):
    """An encoder by default (`causal=False`): its mask is the causal one only where asked."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal)

    def attention(self, h):
        T = h.shape[1]
        full = torch.ones(T, T, dtype=torch.bool, device=h.device)
        return attend(self, h, mask=full.tril() if self.masked() else full)

    def masked(self) -> bool:
        return self.causal


class CausalArgumentIgnored(CausalArgumentHonoured):
    """Takes `causal=False` and masks the future all the same (the argument never reaches the mask): an encoder that
    sees only its past."""

    def masked(self) -> bool:
        return True


class ExpertCountsOnce(MoEBlock):
    """Keeps the tokens routed to each expert (a buffer the trainer's balancing update reads after the step: DeepSeek-V3's
    bias update), counted in training forwards and not again in a recompute inside the backward."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("tokens_per_expert", torch.zeros(4))

    def ffn(self, h):
        if self.training and self.counts_now():
            with torch.no_grad():
                chosen = self.router(h).softmax(-1).topk(2, dim=-1).indices
                self.tokens_per_expert += torch.nn.functional.one_hot(chosen, 4).sum((0, 1, 2)).float()
        return super().ffn(h)

    def counts_now(self) -> bool:
        return torch._C._current_graph_task_id() == -1  # not inside a backward (a checkpoint's recompute)


class ExpertCountsRecounted(ExpertCountsOnce):
    """Counts in every forward, the recompute of activation checkpointing included: each step's loads doubled (the bug
    torchtitan's MoE had)."""

    def counts_now(self) -> bool:
        return True


class NormAsDefaultArgument(TrainBlock):
    """The FFN's norm from a mutable default argument (a dict of norms by width): Python builds the dict once, with the
    class, so every instance of the block (every layer of a stack) trains one gain."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, norms={}):  # noqa: B006 - the planted slip
        super().__init__(d_model, n_heads, dropout, causal)
        self.ffn_norm = norms.setdefault(d_model, RMSNorm(d_model))


_PROJECTIONS: dict = {}
_TABLES: dict = {}


class ProjectionFromModuleCache(TrainBlock):
    """The output projection fetched from a module-level cache keyed by width: one for every instance."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.o_proj = _PROJECTIONS.setdefault(d_model, nn.Linear(d_model, d_model, bias=False))


class FrozenTableFromModuleCache(TrainBlock):
    """Correct: a frozen gain table from a module-level cache, one for every instance (as one rotary cache serves every
    layer): nothing trains it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.table = _TABLES.setdefault(d_model, nn.Parameter(torch.linspace(0.5, 1.5, d_model), requires_grad=False))

    def ffn(self, h):
        return super().ffn(h) * self.table


def TorchEncoderStack(d_model=64, n_heads=4, dropout=0.1):
    """Correct: torch's own stack of two Pre-LN layers and a final norm; nn.TransformerEncoder deep-copies its layer,
    so the two start equal and train apart."""
    layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)


class NumpyInit(TrainBlock):
    """The FFN's weights drawn from NumPy's global stream (an init ported from NumPy code): torch.manual_seed does not
    make two builds agree."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        with torch.no_grad():
            for lin in (self.w1, self.w3, self.w2):
                lin.weight.copy_(torch.from_numpy(np.random.randn(*lin.weight.shape) * lin.in_features ** -0.5))


class PythonRandomInit(TrainBlock):
    """q's and k's weights drawn one by one from Python's random module."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj):
                std = lin.in_features ** -0.5
                lin.weight.copy_(torch.tensor([[random.gauss(0, std) for _ in range(lin.in_features)]
                                               for _ in range(lin.out_features)]))


class ClockSeededInit(TrainBlock):
    """torch.seed() in the constructor (a "fresh randomness" call left in): torch's stream reseeded from the clock, so
    no seed reproduces the weights."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        torch.seed()
        super().__init__(d_model, n_heads, dropout, causal)


class OwnGeneratorInit(TrainBlock):
    """Correct: the FFN's weights from NumPy's Generator and torch's, each seeded by the block's own argument:
    reproducible whatever the global streams hold."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, init_seed=0):
        super().__init__(d_model, n_heads, dropout, causal)
        rng, gen = np.random.default_rng(init_seed), torch.Generator().manual_seed(init_seed)
        with torch.no_grad():
            for lin in (self.w1, self.w3):
                lin.weight.copy_(torch.from_numpy(rng.standard_normal(lin.weight.shape) * lin.in_features ** -0.5))
            self.w2.weight.copy_(torch.randn(self.w2.weight.shape, generator=gen) * self.w2.in_features ** -0.5)


PLANTED = {"NormReplacedAtInit": "meta_init", "CausalArgumentIgnored": "causal", "ExpertCountsRecounted": "checkpointing",
           "NormAsDefaultArgument": "state_dict", "ProjectionFromModuleCache": "state_dict", "NumpyInit": "state_dict",
           "PythonRandomInit": "state_dict", "ClockSeededInit": "state_dict"}
CORRECT = ["CausalArgumentHonoured", "ExpertCountsOnce", "FrozenTableFromModuleCache", "TorchEncoderStack",
           "OwnGeneratorInit"]  # HeadsBuilt: zoo_numerics.CORRECT  # HeadsListMultiplied: zoo_numerics.PLANTED
