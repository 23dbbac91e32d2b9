"""Hugging Face layers at their edges: rembert's factorised embedding width, a config dropout read at call time,
layerdrop off, bloom's ALiBi slopes judged, encoders and mask-free layers described as what they are, the key/value head field
named for --tp, compile's graph breaks counted for the layer alone, and a latent MoE's names read as they are."""

import importlib.util

import pytest
import torch
import torch.nn as nn

import tblock_cli
from tblock_cli.errors import ConfigError
from tblock_cli.messages.compare import compile_graph_breaks
from tblock_cli.report import Status

S = {"d_model": 64, "n_heads": 4, "threads": 1}
pytestmark = pytest.mark.xdist_group("hf")
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")


def by_name(report):
    return {c.name: c for c in report.checks}


@needs_hf
def test_rembert_builds_at_any_width():
    """Its input_embedding_size (256) was left at the checkpoint's: "size of tensor a (64) must match (256)"."""
    by = by_name(tblock_cli.check("hf:rembert", only="shape,finite", **S))
    assert by["shape"].status == Status.PASS and by["finite"].status == Status.PASS


@needs_hf
@pytest.mark.parametrize("family", ["falcon", "persimmon"])
def test_a_config_dropout_read_at_call_time_is_zeroed(family):
    """falcon's self.config.hidden_dropout, persimmon's self.config.attention_dropout: train_eval skipped as random."""
    by = by_name(tblock_cli.check(f"hf:{family}", only="shape,finite,determinism,train_state,input_unchanged,copy,train_eval",
                                  dropout=0.1, **S))
    assert by["train_eval"].status == Status.PASS, by["train_eval"].detail


@needs_hf
def test_layerdrop_never_skips_the_layer_under_test():
    """m2m_100 skips each encoder layer with probability 0.05 in training: a train forward that drew below it never
    reached the layer. Set to 0 (a regulariser of the stack), every seeded train forward runs it."""
    from tblock_cli.subject.setup import setup

    s = setup("hf:m2m_100", {**S, "d_ff": 256})
    with s.session():
        layers = s.build(lambda cfg, n: 0, "check").module
    assert layers.config.encoder_layerdrop == 0.0 and layers.config.decoder_layerdrop == 0.0
    by = by_name(tblock_cli.check("hf:m2m_100", only="global_state", d_ff=256, **S))  # its train forwards at seeds 1, 2
    assert by["global_state"].status == Status.PASS, by["global_state"].detail


@needs_hf
def test_bloom_alibi_slopes_are_judged():
    by = by_name(tblock_cli.check("hf:bloom", only="finite,relative,position_bias", **S))
    assert by["position_bias"].kind == "position_bias.alibi", by["position_bias"].detail
    assert by["position_bias"].facts["slopes"] == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625], rel=1e-3)


class RisingAlibi(nn.Module):
    """Bloom's way (scores = baddbmm(alibi, q, k^T, alpha=1/sqrt(d))) with the slopes' sign flipped: the bias rises
    with distance, which position_bias must fail."""

    def __init__(self, d_model=64, n_heads=4):
        super().__init__()
        self.h, self.d = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / n_heads) for i in range(n_heads)]))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4).reshape(3, B * self.h, T, self.d)
        alibi = -(self.slopes[:, None] * torch.arange(T, dtype=x.dtype)[None, :])  # (H, T): rises with the key index
        alibi = alibi.repeat(B, 1)[:, None, :]  # (B H, 1, T)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=self.d ** -0.5)
        mix = torch.softmax(scores, dim=-1) @ v  # (B H, T, d)
        return x + self.out(mix.view(B, self.h, T, self.d).transpose(1, 2).reshape(B, T, -1))


def test_a_baddbmm_bias_is_read_apart_from_its_product():
    """Before, baddbmm's output (bias included) was taken as the q.k product: no bias seen, position_bias skipped."""
    by = by_name(tblock_cli.check(RisingAlibi(), only="finite,relative,position_bias", **S))
    assert by["position_bias"].status == Status.FAIL and by["position_bias"].kind == "position_bias.rises"


@needs_hf
def test_encoders_and_mask_free_layers_are_described_as_what_they_are():
    assert tblock_cli.params("hf:bert", **S).kv_cache is None  # an encoder keeps no decoding cache
    assert tblock_cli.params("hf:llama", **S).kv_cache is not None
    by = by_name(tblock_cli.check("hf:vit", only="padding", **S))
    assert by["padding"].kind == "padding.hf_no_mask" and "--pad-keyword" not in by["padding"].detail


@needs_hf
def test_tp_names_the_key_value_head_field():
    with pytest.raises(ConfigError, match='num_key_value_heads": 2'):
        tblock_cli.check("hf:mistral", tp=2, only="shape", **S)


def test_graph_breaks_without_a_reason_are_not_the_blocks():
    text = compile_graph_breaks({"count": 0, "graphs": 3, "reasons": []})
    assert text.startswith("0 graph break(s), 3 graph(s) (2 split where the code around the block calls it")


@needs_hf
@pytest.mark.slow
def test_compile_of_an_hf_layer_counts_no_break_of_the_wrappers():
    """transformers' own one-layer gpt2 compiles with none; tblock's wrapper added 1 with an empty reason."""
    r = tblock_cli.compare("hf:gpt2", compile=True, backend="eager", **S)
    (breaks,) = [f for f in r.findings if f.kind == "compile.graph_breaks"]
    assert breaks.facts["count"] == len(breaks.facts["reasons"]) == 0


@needs_hf
def test_a_latent_moes_inner_down_projection_is_its_experts_output():
    """muse_spark's experts sit between a pre and a post projection (each behind a norm): their down_proj both reads
    the GLU and feeds post_expert_proj, and names warned it was "made ffn.in"."""
    c = by_name(tblock_cli.check("hf:muse_spark", only="names", d_ff=256, **S))["names"]
    assert c.status == Status.PASS and "layers.0.mlp.experts.down_proj" in c.facts["names"], c
