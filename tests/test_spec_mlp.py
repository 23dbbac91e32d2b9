"""The ffn, norms and residual entries of the spec card: read off Hugging Face layers they equal the layer's config;
each planted variant is caught by a declared spec check naming the entry, and its correct twin passes."""

from __future__ import annotations

import math

import pytest
import torch
from spec_blocks_mlp import (
    Block,
    DeepNormEncoder,
    DeepNormOnBranch,
    GPT2ExactGelu,
    GPT2Layer,
    NeoXLayer,
    NeoXSequential,
)

import tblock_cli
from tblock_cli.card.ffn import ACTS, fit
from tblock_cli.checks.result import Status

SIZES = {"d_model": 64, "n_heads": 4, "threads": 1}
# With the other tests that build Hugging Face layers (tests/test_hf.py): transformers and the dynamo it pulls in
# (~3 s) are imported on one worker only.
HF = pytest.mark.xdist_group("hf")

# Hugging Face's activation names, as the card names the curve
HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
          "silu": "silu", "swish": "silu", "relu": "relu", "quick_gelu": "quick_gelu"}


def _hf_card(model_type: str, **kwargs):
    """The card of one hf: layer and that layer's own config."""
    pytest.importorskip("transformers")
    from tblock_cli.card.read import read_card
    from tblock_cli.subject.setup import setup

    s = setup(f"hf:{model_type}", {**SIZES, "d_ff": 128, **({"kwargs": kwargs} if kwargs else {})}, trains=False)
    with s.session():
        subject = s.make()
        return read_card(subject, s.cfg, s.device), subject.module.config


# model type -> (config overrides, the config fields naming activation and eps, norm kind, placement, offset, gated,
# parallel as the config says it)
FAMILIES = {
    "gpt2": ({}, "activation_function", "layer_norm_epsilon", "layernorm", "pre", False, False, lambda c: False),
    "bert": ({}, "hidden_act", "layer_norm_eps", "layernorm", "post", False, False, lambda c: False),
    "llama": ({}, "hidden_act", "rms_norm_eps", "rmsnorm", "pre", False, True, lambda c: False),
    "gemma2": ({}, "hidden_activation", "rms_norm_eps", "rmsnorm", "sandwich", True, True, lambda c: False),
    "olmo2": ({}, "hidden_act", "rms_norm_eps", "rmsnorm", "olmo2", False, True, lambda c: False),
    "gpt_neox": ({}, "hidden_act", "layer_norm_eps", "layernorm", "pre", False, False, lambda c: c.use_parallel_residual),
    "gpt_neox-seq": ({"use_parallel_residual": False}, "hidden_act", "layer_norm_eps", "layernorm", "pre", False, False,
                     lambda c: c.use_parallel_residual),
    "falcon": ({}, "activation", "layer_norm_epsilon", "layernorm", "pre", False, False,
               lambda c: c.parallel_attn or c.new_decoder_architecture),
    "falcon-seq": ({"parallel_attn": False}, "activation", "layer_norm_epsilon", "layernorm", "pre", False, False,
                   lambda c: c.parallel_attn or c.new_decoder_architecture),
    "phi": ({}, "hidden_act", "layer_norm_eps", "layernorm", "pre", False, False, lambda c: True),  # phi: always parallel
    "t5": ({}, "dense_act_fn", "layer_norm_epsilon", "rmsnorm", "pre", False, None, lambda c: False),
}


@HF
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_card_equals_the_config(family):
    kwargs, act, eps, kind, placement, offset, gated, parallel = FAMILIES[family]
    card, config = _hf_card(family.split("-")[0], **kwargs)
    assert not card.slips, card.slips
    assert card.value("ffn.act") == HF_ACT[getattr(config, act)]
    assert card.value("ffn.gated") is (config.is_gated_act if gated is None else gated)
    assert card.value("ffn.hidden") == 128
    assert card.value("norm.kind") == kind
    assert card.value("norm.eps") == pytest.approx(getattr(config, eps), rel=1e-4)
    assert card.value("norm.offset") is offset
    assert card.value("norm.placement") == placement
    assert card.value("residual.form") == ("parallel" if parallel(config) else "sequential")
    for key in ("residual.stream_gain", "residual.attn_gain", "residual.ffn_gain"):
        assert card.value(key) == pytest.approx(1.0, abs=1e-9), key


@HF
def test_granite_residual_multiplier_is_each_branch_gain():
    card, config = _hf_card("granite", residual_multiplier=0.22)
    assert card.value("residual.attn_gain") == pytest.approx(config.residual_multiplier, rel=1e-9)
    assert card.value("residual.ffn_gain") == pytest.approx(config.residual_multiplier, rel=1e-9)
    assert card.value("residual.stream_gain") == pytest.approx(1.0, rel=1e-9)


def _spec(block, expect):
    report = tblock_cli.check(block, only=["spec"], expect=expect, **SIZES)
    return next(c for c in report.checks if c.name == "spec")


# (planted variant, its correct twin, the declaration, the entry that must differ)
PLANTED = {
    "gelu_exact_for_tanh": (dict(act="gelu", gated=False), dict(act="gelu_tanh", gated=False), ["ffn.act=gelu_tanh"], "ffn.act"),
    "relu_for_gelu": (dict(act="relu", gated=False), dict(act="gelu", gated=False), ["ffn.act=gelu"], "ffn.act"),
    "gelu_for_silu": (dict(act="gelu"), dict(act="silu"), ["ffn.act=silu", "ffn.gated=true"], "ffn.act"),
    "act_of_product": (dict(product_inside=True), dict(), ["ffn.act=silu"], "ffn.act"),
    "not_gated": (dict(gated=False), dict(), ["ffn.gated=true"], "ffn.gated"),
    "eps": (dict(eps=1e-5), dict(eps=1e-6), ["norm.eps=1e-6"], "norm.eps"),
    "no_offset": (dict(offset=False), dict(offset=True), ["norm.offset=true"], "norm.offset"),
    "layernorm_for_rms": (dict(norm="ln"), dict(norm="rms"), ["norm.kind=rmsnorm"], "norm.kind"),
    "no_sandwich": (dict(placement="pre"), dict(placement="sandwich"), ["norm.placement=sandwich"], "norm.placement"),
    "parallel_forced": (dict(parallel=True), dict(), ["residual.form=sequential"], "residual.form"),
    "sequential_for_parallel": (dict(), dict(parallel=True), ["residual.form=parallel"], "residual.form"),
    "deepnorm_on_branch": (dict(placement="post", norm="ln", alpha=2.0, alpha_on="branch"),
                           dict(placement="post", norm="ln", alpha=2.0), ["residual.stream_gain=2"], "residual.stream_gain"),
    "layerscale_missing": (dict(), dict(layerscale=0.1), ["residual.attn_gain=0.1", "residual.ffn_gain=0.1"],
                           "residual.attn_gain"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_variant_is_caught_and_its_twin_passes(name):
    bug, twin, expect, key = PLANTED[name]
    torch.manual_seed(0)
    caught = _spec(Block(**bug), expect)
    assert caught.status == Status.FAIL, caught
    assert key in [d["key"] for d in caught.facts["differs"]], caught.facts
    torch.manual_seed(0)
    passed = _spec(Block(**twin), expect)
    assert passed.status == Status.PASS, passed.facts
    assert passed.facts["matched"] == len(expect)


def test_layerscale_is_read_per_channel():
    from tblock_cli.card.read import read_card
    from tblock_cli.subject.setup import setup

    torch.manual_seed(0)
    block = Block(layerscale=0.1)
    with torch.no_grad():
        block.g_attn.copy_(torch.linspace(0.05, 0.15, 64))  # mean 0.1, one value per channel
    s = setup(block, dict(SIZES), trains=False)
    with s.session():
        card = read_card(s.make(), s.cfg, s.device)
    e = card.get("residual.attn_gain")
    assert e.value == pytest.approx(block.g_attn.double().mean().item(), rel=1e-9) and "per channel" in e.how
    assert card.value("residual.ffn_gain") == pytest.approx(block.g_ffn.double().mean().item(), rel=1e-9)


def _card(block):
    from tblock_cli.card.read import read_card
    from tblock_cli.subject.setup import setup

    s = setup(block, dict(SIZES), trains=False)
    with s.session():
        return read_card(s.make(), s.cfg, s.device)


@pytest.mark.parametrize("parallel", [False, True])
def test_layerscale_modules_at_their_init_are_gains_not_norms(parallel):
    """timm's LayerScale (x * gamma, gamma 1e-5 at init) is a module with one 1-D parameter of the stream's width: it
    scales with its input, so it is no norm, and with it the FFN's input still moves when attention's output does."""
    torch.manual_seed(0)
    card = _card(Block(layerscale=1e-5, ls_modules=True, parallel=parallel))
    assert card.value("norm.placement") == "pre"
    assert card.value("norm.kind") == "rmsnorm" and card.value("norm.eps") == pytest.approx(1e-6, rel=1e-3)
    assert card.value("residual.form") == ("parallel" if parallel else "sequential")
    assert card.value("residual.attn_gain") == pytest.approx(1e-5, rel=1e-6)
    assert card.value("residual.ffn_gain") == pytest.approx(1e-5, rel=1e-6)
    assert card.value("residual.stream_gain") == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("parallel", [False, True])
def test_zero_initialised_output_projections_keep_the_form_and_leave_the_gains_unread(parallel):
    """modded-nanogpt zeroes each branch's output projection at init: the branches add nothing yet, which says
    neither that the FFN ignores attention (parallel) nor that the gains are 0."""
    torch.manual_seed(0)
    card = _card(Block(zero_out=True, parallel=parallel))
    assert card.value("residual.form") == ("parallel" if parallel else "sequential")
    assert card.value("residual.stream_gain") == pytest.approx(1.0, rel=1e-9)
    for key in ("residual.attn_gain", "residual.ffn_gain"):
        e = card.get(key)
        assert e.value is None and "zero" in e.skip, e
    caught = _spec(Block(zero_out=True), ["residual.form=sequential", "residual.attn_gain=1"])
    assert caught.status == Status.PASS, caught.facts


def test_spec_and_check_read_zero_initialised_branches_at_random_weights():
    """`tblock spec` and `check` draw the zero projections (and say so): the gains are read, a wrong one is named,
    and the block keeps its zeros."""
    torch.manual_seed(0)
    block = Block(zero_out=True)
    report = tblock_cli.spec(block, **SIZES)
    for key in ("residual.attn_gain", "residual.ffn_gain"):
        assert report.card.value(key) == pytest.approx(1.0, rel=1e-9), report.card.get(key)
    assert any("o.weight" in w and "down.weight" in w and "drawn at random" in w for w in report.run.warnings)
    assert not block.o.weight.any() and not block.down.weight.any()
    caught = _spec(block, ["residual.attn_gain=2"])
    assert caught.status == Status.FAIL and [d["key"] for d in caught.facts["differs"]] == ["residual.attn_gain"]


def test_fit_names_each_curve_and_the_mistaken_product():
    """The fit against curves computed here: each activation, gated either way, and act(gate * up)."""
    g = torch.linspace(-4, 4, 400, dtype=torch.float64).unsqueeze(0)
    u = torch.linspace(3, -2, 400, dtype=torch.float64).unsqueeze(0) ** 2 - 1
    for act, f in ACTS.items():
        if act == "identity":
            continue
        best = fit(f(g), {"a": g, "b": u})[0]
        assert (best[1], best[2]) == (act, False) and best[0] < 1e-15
        best = fit(f(g) * u, {"a": g, "b": u})[0]
        assert (best[1], best[2]) == (act, True) and best[0] < 1e-15
    best = fit(torch.nn.functional.silu(g * u), {"a": g, "b": u})[0]
    assert best[1] == "silu(gate*up)"


def test_deepnorm_gain_on_the_branch_is_caught_as_declared():
    """alpha = (2 x 6)^(1/4) = 1.8612, declared to three digits; on the branch it reads 1 / alpha on the stream."""
    torch.manual_seed(0)
    caught = _spec(DeepNormOnBranch(), ["residual.stream_gain=1.86"])
    assert caught.status == Status.FAIL
    assert caught.facts["differs"][0]["measured"] == pytest.approx(12 ** -0.25, rel=1e-6)
    torch.manual_seed(0)
    assert _spec(DeepNormEncoder(), ["residual.stream_gain=1.86", "norm.placement=post"]).status == Status.PASS


def _like(block, like, **kwargs):
    """The spec check against an hf: layer: the entries of this area that differ."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    report = tblock_cli.check(block, only=["spec"], like=like, causal=True, **kwargs, **SIZES)
    spec = next(c for c in report.checks if c.name == "spec")
    return {d["key"]: d for d in spec.facts.get("differs", []) if d["key"].startswith(("ffn.", "norm.", "residual."))}


@HF
def test_exact_gelu_where_gpt2_trained_tanh_is_caught_against_hf_gpt2():
    assert _like(GPT2ExactGelu(), "hf:gpt2") == {"ffn.act": {"key": "ffn.act", "status": "differs", "claimed": "gelu_tanh",
                                                             "measured": "gelu", "source": "--like hf:gpt2"}}
    assert _like(GPT2Layer(), "hf:gpt2") == {}


@HF
def test_parallel_residual_forced_is_caught_against_a_sequential_gpt_neox():
    sequential = {"use_parallel_residual": False}
    assert set(_like(NeoXLayer(), "hf:gpt_neox", like_kwargs=sequential)) == {"residual.form"}
    assert _like(NeoXSequential(), "hf:gpt_neox", like_kwargs=sequential) == {}
    assert _like(NeoXLayer(), "hf:gpt_neox") == {}  # the config's default: parallel


@pytest.mark.parametrize("d_ff", [256, 4096])
def test_a_curve_of_its_own_is_told_from_a_known_curve_normed_after_or_rounded(d_ff):
    """A mistyped tanh GELU is a smooth curve no known one fits; GELU followed by a LayerNorm (NormFormer) is a known
    curve up to a scale and shift per row, however wide (its statistics barely move between rows); GELU rounded to
    bfloat16 misses by noise. Only the first is 'a curve of its own'."""
    from tblock_cli.card.ffn import own_curve

    p = torch.randn(16, d_ff, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = p * 4 / p.abs().max()
    typo = 0.5 * p * (1 + torch.tanh(math.sqrt(2 / math.pi) * (p + 0.44715 * p ** 3)))
    normed = torch.nn.functional.layer_norm(torch.nn.functional.gelu(p), (d_ff,))
    rounded = torch.nn.functional.gelu(p.bfloat16()).double()
    cands = {"up": p}
    assert own_curve(typo, cands, fit(typo, cands)) is not None
    assert own_curve(normed, cands, fit(normed, cands)) is None
    assert own_curve(rounded, cands, fit(rounded, cands)) is None
