"""The moe entries of the spec card: read off Hugging Face MoE layers (the card equals their config), off blocks
written the way users write them, and planted routing bugs caught by the declared spec check."""

from __future__ import annotations

import pytest
from spec_blocks_moe import DenseBlock, FlatBlock, HeadsListBlock, InnerResidualBlock, MoEBlock

import tblock_cli
from tblock_cli.card.read import read_card

SIZES = {"d_model": 32, "n_heads": 4, "d_ff": 64, "threads": 1}
# with the other transformers tests (tests/test_hf.py): the import is paid once
pytestmark = pytest.mark.xdist_group("hf")


def card_of(block, **options):
    from tblock_cli.subject.setup import setup

    s = setup(block, {**SIZES, **options}, trains=False)
    with s.session():
        subject = s.make()
        return read_card(subject, s.cfg, s.device), getattr(subject.module, "config", None)


def moe(card) -> dict:
    return {e.key: e.value for e in card.entries if e.key.startswith("moe.") and e.read}


def spec_check(factory, expect=None, like=None, like_kwargs=None):
    r = tblock_cli.check(factory, expect=expect, like=like, like_kwargs=like_kwargs, only=["spec"], **SIZES)
    (c,) = [c for c in r.checks if c.name == "spec"]
    return c


# --- Hugging Face layers: the card equals the config -------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_mixtral_card_is_its_config(transformers):
    card, config = card_of("hf:mixtral", d_model=64)
    got = moe(card)
    assert got["moe.experts"] == config.num_local_experts
    assert got["moe.top_k"] == config.num_experts_per_tok
    assert got["moe.router"] == "softmax" and got["moe.renorm"] is True  # softmax, top-k, renormalised
    assert got["moe.weight_sum"] == pytest.approx(1, rel=1e-6) and got["moe.scale"] == pytest.approx(1, rel=1e-6)
    assert got["moe.shared"] is False and got["moe.select"] == "top"


@pytest.mark.parametrize("norm", [False, True])
def test_qwen2_moe_card_is_its_config(transformers, norm):
    card, config = card_of("hf:qwen2_moe", d_model=64, kwargs={"num_experts": 16, "norm_topk_prob": norm})
    got = moe(card)
    assert (got["moe.experts"], got["moe.top_k"]) == (config.num_experts, config.num_experts_per_tok)
    assert got["moe.router"] == "softmax" and got["moe.renorm"] is config.norm_topk_prob
    # without renormalisation a token's weights sum to its top-k softmax mass (< 1, by token)
    assert got["moe.weight_sum"] == (pytest.approx(1, rel=1e-6) if norm else "varies")
    assert got["moe.shared"] is True and got["moe.shared_gate"] == "sigmoid"  # shared_expert_gate


def test_deepseek_v3_card_is_its_config(transformers):
    card, config = card_of("hf:deepseek_v3", d_model=64,
                           kwargs={"n_routed_experts": 16, "first_k_dense_replace": 0})
    got = moe(card)
    assert (got["moe.experts"], got["moe.top_k"]) == (config.n_routed_experts, config.num_experts_per_tok)
    assert got["moe.router"] == "sigmoid" and got["moe.renorm"] is config.norm_topk_prob
    assert got["moe.scale"] == pytest.approx(config.routed_scaling_factor, rel=1e-6)
    assert got["moe.weight_sum"] == pytest.approx(config.routed_scaling_factor, rel=1e-6)
    assert got["moe.shared"] is True and got["moe.shared_gate"] == "none"  # shared_experts, ungated


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
def test_softmax_families_without_renorm_by_default(transformers, family):
    card, config = card_of(f"hf:{family}", d_model=64, kwargs={"num_experts": 16})
    got = moe(card)
    assert (got["moe.experts"], got["moe.top_k"]) == (config.num_experts, config.num_experts_per_tok)
    assert got["moe.router"] == "softmax" and got["moe.renorm"] is bool(config.norm_topk_prob)


def test_switch_card_is_its_config(transformers):
    """Top-1, the chosen expert's softmax probability as its weight (not renormalised); its experts carry dropout,
    which the reading runs without."""
    card, config = card_of("hf:switch_transformers", d_model=64, kwargs={"encoder_sparse_step": 1, "num_experts": 8})
    got = moe(card)
    assert (got["moe.experts"], got["moe.top_k"]) == (config.num_experts, 1)
    assert got["moe.router"] == "softmax" and got["moe.renorm"] is False and got["moe.weight_sum"] == "varies"


def test_dense_layer_reads_no_experts(transformers):
    card, _ = card_of("hf:llama", d_model=64)
    assert card.value("moe.experts") == 0
    assert card.get("moe.top_k").skip == "no experts" and card.get("moe.renorm").skip == "no experts"


# --- blocks written by users --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, want", [
    ({}, {"moe.top_k": 2, "moe.router": "softmax", "moe.renorm": True, "moe.weight_sum": 1.0, "moe.shared": False}),
    # softmax over the top-k logits is softmax-then-top-k-then-renormalise
    ({"order": "after", "renorm": False}, {"moe.renorm": True, "moe.weight_sum": 1.0}),
    ({"renorm": False}, {"moe.router": "softmax", "moe.renorm": False, "moe.weight_sum": "varies"}),
    ({"router": "sigmoid", "renorm": False, "scale": 2.5}, {"moe.router": "sigmoid", "moe.renorm": False,
                                                            "moe.scale": 2.5}),
    ({"router": "sigmoid", "scale": 2.5}, {"moe.router": "sigmoid", "moe.renorm": True, "moe.weight_sum": 2.5}),
    ({"top_k": 3}, {"moe.top_k": 3}),
    ({"shared": True}, {"moe.shared": True, "moe.shared_gate": "sigmoid"}),
    ({"shared": True, "shared_gate": False}, {"moe.shared": True, "moe.shared_gate": "none"}),
])
def test_user_blocks_read_as_written(kw, want):
    card, _ = card_of(lambda: MoEBlock(32, 4, 64, **kw))
    got = moe(card)
    assert got["moe.experts"] == 8
    for k, v in want.items():
        assert got[k] == (pytest.approx(v, rel=1e-9) if isinstance(v, float) else v), k


@pytest.mark.parametrize("block", [DenseBlock, HeadsListBlock])
def test_blocks_without_routing_read_no_experts(block):
    card, _ = card_of(block)
    assert card.value("moe.experts") == 0 and card.get("moe.top_k").skip == "no experts"


def test_reading_restores_the_weights():
    import copy

    from tblock_cli.card import moe as reader
    from tblock_cli.card.probe import float64_probe
    from tblock_cli.subject.setup import setup

    s = setup(lambda: MoEBlock(32, 4, 64, shared=True), dict(SIZES), trains=False)
    with s.session():
        probe = float64_probe(s.make(), s.cfg, s.device)
        before = copy.deepcopy(probe.module.state_dict())
        reader.read(probe)
        after = probe.module.state_dict()
    assert all((before[k] == after[k]).all() for k in before)


# --- planted bugs, caught by the declared check; the correct twin passes -----------------------------------------

MIXTRAL = ["moe.top_k=2", "moe.router=softmax", "moe.renorm=true", "moe.weight_sum=1", "moe.shared=false"]
QWEN2_MOE = ["moe.top_k=2", "moe.router=softmax", "moe.renorm=false", "moe.weight_sum=varies", "moe.shared=true",
             "moe.shared_gate=sigmoid"]
DEEPSEEK = ["moe.router=sigmoid", "moe.renorm=true", "moe.scale=2.5", "moe.weight_sum=2.5"]


@pytest.mark.parametrize("kw, claims, wrong", [
    ({"renorm": False}, MIXTRAL, {"moe.renorm", "moe.weight_sum"}),  # top-k weights not renormalised
    ({"top_k": 1}, MIXTRAL, {"moe.top_k"}),  # wrong top-k
    ({"router": "sigmoid"}, MIXTRAL, {"moe.router"}),  # sigmoid where softmax was trained
    ({"order": "after", "shared": True}, QWEN2_MOE, {"moe.renorm", "moe.weight_sum"}),  # softmax after the top-k
    ({"shared": True, "shared_gate": False}, QWEN2_MOE, {"moe.renorm", "moe.weight_sum", "moe.shared_gate"}),
    ({"router": "sigmoid"}, DEEPSEEK, {"moe.scale", "moe.weight_sum"}),  # routed_scaling_factor dropped
    ({"scale": 2.5}, DEEPSEEK, {"moe.router"}),  # softmax where the sigmoid was trained
])
def test_planted_routing_bugs_are_caught(kw, claims, wrong):
    c = spec_check(lambda: MoEBlock(32, 4, 64, **kw), expect=claims)
    assert c.status.value == "fail" and {d["key"] for d in c.facts["differs"]} == wrong


def test_one_expert_renormalised_is_a_gate_of_one_that_trains_no_router():
    """top-1 with its weight renormalised over the chosen expert: p / p = 1 whatever the router says, so no gradient
    reaches the router. Judged where the card reads both (warned; a declared top-k that differs still fails first).
    Twin: top-1 keeping the probability (Switch)."""
    c = spec_check(lambda: MoEBlock(32, 4, 64, top_k=1), expect=["moe.top_k=1"])
    assert c.status.value == "warn" and c.kind == "spec.constant_gate", c
    c = spec_check(lambda: MoEBlock(32, 4, 64, top_k=1, renorm=False), expect=["moe.top_k=1"])
    assert c.status.value == "pass" and c.kind == "spec.matches", c


@pytest.mark.parametrize("kw, claims", [
    ({}, MIXTRAL),
    ({"renorm": False, "shared": True}, QWEN2_MOE),
    ({"router": "sigmoid", "scale": 2.5}, DEEPSEEK),
])
def test_correct_twins_pass(kw, claims):
    c = spec_check(lambda: MoEBlock(32, 4, 64, **kw), expect=claims)
    assert c.status.value == "pass" and c.facts["matched"] == len(claims)


def test_like_mixtral_catches_the_missing_renormalisation(transformers):
    good = spec_check(lambda: MoEBlock(32, 4, 64), like="hf:mixtral")
    bad = spec_check(lambda: MoEBlock(32, 4, 64, renorm=False), like="hf:mixtral")
    assert {d["key"] for d in bad.facts["differs"]} >= {"moe.renorm", "moe.weight_sum"}
    assert not {d["key"] for d in good.facts.get("differs", []) if d["key"].startswith("moe.")}


@pytest.mark.parametrize("kw, want", [
    ({}, {"moe.router": "softmax", "moe.renorm": True}),
    ({"renorm": False}, {"moe.router": "softmax", "moe.renorm": False}),
    ({"router": "sigmoid", "renorm": False, "scale": 2.5}, {"moe.router": "sigmoid", "moe.renorm": False}),
])
def test_stacked_experts_no_expert_callable_alone_read_from_ratios(kw, want):
    """Experts as (E, f, d) matrices applied by einsum: no expert can be run alone, so the weights' sum and the
    routed scale are left unread with why; the router's form and renormalisation still read (ratios of weights,
    and the sum against its value with every score equal)."""
    card, _ = card_of(lambda: MoEBlock(32, 4, 64, stacked=True, **kw))
    got = moe(card)
    assert got["moe.experts"] == 8 and got["moe.top_k"] == 2
    assert {k: got[k] for k in want} == want
    assert "could not be computed alone" in card.get("moe.weight_sum").skip
    assert "could not be computed alone" in card.get("moe.scale").skip


def test_stacked_experts_missing_renormalisation_is_caught():
    c = spec_check(lambda: MoEBlock(32, 4, 64, stacked=True, renorm=False), expect=MIXTRAL)
    assert c.status.value == "fail" and {d["key"] for d in c.facts["differs"]} == {"moe.renorm"}
    assert "moe.weight_sum" in c.facts["unread_keys"]


@pytest.mark.parametrize("renorm", [True, False])
def test_a_router_initialised_to_zeros_reads_as_its_form(renorm):
    """Every score tied at init: the router's weights are redrawn while read, so the form still shows."""
    card, _ = card_of(lambda: MoEBlock(32, 4, 64, renorm=renorm, zero_router=True))
    got = moe(card)
    assert got["moe.renorm"] is renorm and got["moe.router"] == "softmax"
    assert got["moe.weight_sum"] == (pytest.approx(1, rel=1e-9) if renorm else "varies")


@pytest.mark.parametrize("kw", [{}, {"renorm": False, "shared": True}])
def test_a_mixture_module_with_its_own_norm_and_residual(kw):
    """The residual inside the mixture module is not a shared expert; the experts read the normalised stream (the
    router's input), not the module's."""
    card, _ = card_of(lambda: InnerResidualBlock(32, 4, 64, **kw))
    got = moe(card)
    assert got["moe.shared"] is bool(kw.get("shared")) and got["moe.renorm"] is kw.get("renorm", True)
    assert got.get("moe.shared_gate") == ("sigmoid" if kw.get("shared") else None)
    assert got["moe.weight_sum"] == (pytest.approx(1, rel=1e-9) if kw.get("renorm", True) else "varies")


@pytest.mark.parametrize("renorm", [True, False])
def test_router_and_experts_held_by_the_block_itself(renorm):
    """No mixture module: read at the block's output (a shared path then cannot be told from the residual)."""
    card, _ = card_of(lambda: FlatBlock(32, 4, 64, renorm=renorm))
    got = moe(card)
    assert (got["moe.experts"], got["moe.top_k"], got["moe.renorm"]) == (8, 2, renorm)
    assert got["moe.weight_sum"] == (pytest.approx(1, rel=1e-9) if renorm else "varies")
    assert "not a module of its own" in card.get("moe.shared").skip


def test_like_deepseek_v3_reads_its_moe_entries_on_an_moe_layer(transformers):
    """hf:deepseek_v3's layer 0 is dense by config (first_k_dense_replace=3): the reference's moe entries are read
    on an MoE layer of the family, so a port of its MoE layer is held against them."""
    like = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
    twin = dict(router="sigmoid", scale=2.5, shared=True, shared_gate=False)
    good = spec_check(lambda: MoEBlock(32, 4, 64, **twin), like="hf:deepseek_v3", like_kwargs=like)
    bad = spec_check(lambda: MoEBlock(32, 4, 64, **{**twin, "scale": 1.0}), like="hf:deepseek_v3", like_kwargs=like)
    assert not [d for d in good.facts.get("differs", []) if d["key"].startswith("moe.")]
    assert {d["key"] for d in bad.facts["differs"] if d["key"].startswith("moe.")} == {"moe.scale", "moe.weight_sum"}
