"""T5's relative-position buckets as a block says it has them (a config's relative_attention_num_buckets,
relative_attention_max_distance and is_decoder) and computes them otherwise: a decoder bucketing both ways, the
max_distance not passed on, an integer division before the log; and a bias drawn as large as x-transformers draws
its own (N(0, 1) times sqrt(d_head)), which saturates attention at init by design, not by its q and k."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from zoo_training import TrainBlock, attend


@dataclass
class T5Config:
    model_type: str = "t5"  # as transformers' T5Config names its family: T5's scores are unscaled by design
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    is_decoder: bool = False


def bucket(rel: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int, floor_first: bool = False):
    """transformers' T5Attention._relative_position_bucket (floor_first: the distance integer-divided before its log)."""
    out = torch.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        out = out + (rel > 0).long() * buckets
        n = rel.abs()
    else:
        n = -torch.min(rel, torch.zeros_like(rel))
    exact = buckets // 2
    ratio = (n // exact).float() if floor_first else n.float() / exact
    large = exact + (torch.log(ratio.clamp_min(1e-6)) / math.log(max_distance / exact) * (buckets - exact)).long()
    return out + torch.where(n < exact, n, torch.min(large, torch.full_like(large, buckets - 1)))


class T5Encoder(TrainBlock):
    """Correct: T5's bidirectional buckets (32, to 128) on unscaled scores, its bias embedding drawn as T5 draws it."""

    decoder, both_ways, max_distance, floor_first, family = False, None, None, False, "t5"

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal or self.decoder)
        self.config = T5Config(model_type=self.family, is_decoder=self.decoder)
        self.relative_attention_bias = nn.Embedding(self.config.relative_attention_num_buckets, n_heads)
        if self.family == "t5":
            nn.init.normal_(self.relative_attention_bias.weight, std=d_model**-0.5)
            for p in (self.q_proj, self.k_proj):  # T5's init folds 1/sqrt(d_head) into the query and key weights
                nn.init.normal_(p.weight, std=(d_model * d_model // n_heads) ** -0.25)
        else:  # x-transformers' RelativePositionBias: N(0, 1) embeddings times sqrt(dim_head), its default dim_head 64
            nn.init.normal_(self.relative_attention_bias.weight, std=8.0)
        self.rotary = nn.Identity()

    def attention(self, h):
        T = h.shape[1]
        i = torch.arange(T, device=h.device)
        both = not self.decoder if self.both_ways is None else self.both_ways
        b = bucket(i[None, :] - i[:, None], both, self.config.relative_attention_num_buckets,
                   self.max_distance or self.config.relative_attention_max_distance, self.floor_first)
        mask = torch.ones(T, T, dtype=torch.bool, device=h.device)
        return attend(self, h, mask=mask.tril() if self.decoder else mask,
                      bias=self.relative_attention_bias(b).permute(2, 0, 1), scale=1.0 if self.family == "t5" else None)


class T5Decoder(T5Encoder):
    """Correct: a decoder layer's buckets, one way (earlier keys only), on a causal mask."""

    decoder = True


class LargeBiasDecoder(T5Decoder):
    """Correct: x-transformers' relative bias on scaled scores, drawn N(0, 1) times 8 (its RelativePositionBias scale,
    sqrt of its default dim_head 64): the bias saturates attention at init (logit std 7.7 against a q.k part of 0.34),
    a prior training moves; `attention` must not blame q and k for it (it warned `saturated` before). No family named."""

    family = ""


class DecoderBucketedBothWays(T5Decoder):
    """A decoder (is_decoder True) bucketing both ways: half the buckets for earlier keys, the others never used."""

    both_ways = True


class MaxDistanceDropped(T5Encoder):
    """relative_attention_max_distance 128 kept, 32 used (a default left in a helper's signature)."""

    max_distance = 32


class DistanceFloored(T5Encoder):
    """n // max_exact before the log where n / max_exact was meant: buckets step at multiples of 8 only."""

    floor_first = True


PLANTED = {"DecoderBucketedBothWays": "relbias.steps", "MaxDistanceDropped": "relbias.steps",
           "DistanceFloored": "relbias.steps"}
CORRECT = ["T5Encoder", "T5Decoder", "LargeBiasDecoder"]
