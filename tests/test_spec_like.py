"""check --like hf:TYPE: the block against that Hugging Face layer with its weights carried (like_reference)."""

from pathlib import Path

import pytest

import tblock_cli

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("hf")

Z = f"{Path(__file__).parent / 'zoo_compare.py'}:"
SIZES = {"d_model": 32, "n_heads": 4, "seq": 8, "threads": 1}
GQA = {"kwargs": {"n_kv_heads": 2}, "like_kwargs": {"num_key_value_heads": 2}}


def like_llama(name: str):
    report = tblock_cli.check(Z + name, like="hf:llama", only="like_reference", **SIZES, **GQA)
    (result,) = report.checks
    return result


def test_a_faithful_llama_computes_what_hf_llama_computes():
    r = like_llama("ScratchLlama")
    assert (r.status.value, r.kind) == ("pass", "like_reference.same") and r.value < 1e-5


def test_gate_and_up_swapped_fails_naming_the_ffn():
    r = like_llama("LlamaGateUpSwapped")
    assert (r.status.value, r.kind) == ("fail", "like_reference.differs")
    assert "outputs" in r.facts["differ"] and "ffn" in r.facts["first"].lower()


def test_the_other_rotary_layout_is_a_weight_convention_not_a_failure():
    r = like_llama("LlamaInterleavedRope")
    assert (r.status.value, r.kind) == ("pass", "like_reference.rotary_layout")
    assert r.facts["rotary"] == {"a": "interleaved", "b": "half-split"}


def test_weights_that_cannot_be_carried_skip_with_the_reason():
    report = tblock_cli.check(Z + "ScratchLlama", like="hf:llama", only="like_reference", **SIZES,
                              kwargs={"n_kv_heads": 2})  # hf:llama keeps 4 key/value heads: k/v widths differ
    (r,) = report.checks
    assert (r.status.value, r.kind) == ("skip", "like_reference.not_compared") and "carry" in r.facts["why"]


EXAMPLE = f"{Path(__file__).parent.parent / 'examples' / 'llama_layer.py'}:LlamaLayer"
LAYER = {"d_model": 32, "n_heads": 4, "d_ff": 64, "seq": 8, "threads": 1, "causal": True}


def test_the_example_whose_rotary_ignores_its_theta_is_caught_by_both_checks():
    report = tblock_cli.check(EXAMPLE, kwargs={"rope_theta": 500000.0}, like="hf:llama",
                              like_kwargs={"rope_theta": 500000.0}, only="spec,like_reference", **LAYER)
    spec, like = report.checks
    assert (spec.status.value, like.status.value) == ("fail", "fail")
    assert {d["key"] for d in spec.facts["differs"]} == {"rope.theta", "rope.freqs"}
    theta = next(d for d in spec.facts["differs"] if d["key"] == "rope.theta")
    assert abs(theta["measured"] - 1e4) < 1e2 and theta["claimed"] == pytest.approx(5e5, rel=1e-6)


def test_a_transformers_4_rotary_key_means_the_same_reference():
    """rope_theta (transformers 4's field) and rope_parameters (5's) build the same reference; the example's own
    base, 10000, then matches."""
    for like_kwargs in ({"rope_theta": 10000.0}, {"rotary_emb_base": 10000.0}):
        report = tblock_cli.check(EXAMPLE, like="hf:llama", like_kwargs=like_kwargs, only="spec,like_reference",
                                  **LAYER)
        assert [c.status.value for c in report.checks] == ["pass", "pass"], [c.detail for c in report.checks]
    report = tblock_cli.spec("hf:llama", kwargs={"rope_scaling": {"type": "linear", "factor": 4.0}}, d_model=32,
                             n_heads=4, threads=1)
    assert report.card.value("rope.scaling") == "linear" and report.card.value("rope.factor") == pytest.approx(4.0, rel=0.02)


def test_a_reference_that_cannot_be_built_is_named_by_its_own_flags():
    from tblock_cli.errors import TBlockError

    with pytest.raises(TBlockError, match="^--like-kwargs: llama's config has no field 'bogus'"):
        tblock_cli.spec(d_model=32, n_heads=4, threads=1, like="hf:llama", like_kwargs={"bogus": 1})
    with pytest.raises(TBlockError, match="^--like hf:no_such_type: not a transformers model type"):
        tblock_cli.spec(d_model=32, n_heads=4, threads=1, like="hf:no_such_type")


def test_parameters_the_reference_lacks_fail_though_the_function_agrees_once_they_are_zeroed():
    r = like_llama("BiasedLlama")
    assert (r.status.value, r.kind) == ("fail", "like_reference.params_differ") and r.value < 1e-5
    # the key bias too: rotated with its key's position, it no longer moves every score of a row alike (without
    # rotary it would, and softmax would ignore it: BERT's key bias, tested below)
    assert sorted(r.facts["extra"]) == [f"self_attn.{p}_proj.bias" for p in "koqv"] and r.facts["lacking"] == []


def test_eps_outside_the_square_root_is_read_as_another_eps_form_than_llamas():
    report = tblock_cli.check(Z + "EpsOutsideLlama", like="hf:llama", like_kwargs={"num_key_value_heads": 2,
                              "rms_norm_eps": 1e-6}, kwargs={"n_kv_heads": 2}, only="spec", **SIZES)
    (spec,) = report.checks
    assert spec.status.value == "fail", spec.detail
    assert [(d["key"], d["measured"], d["claimed"]) for d in spec.facts["differs"]] == [("norm.eps_form", "std", "sqrt")]
    card = tblock_cli.spec(Z + "ScratchLlama", d_model=32, n_heads=4, threads=1).card
    assert (card.value("norm.eps_form"), card.value("norm.eps")) == ("sqrt", pytest.approx(1e-6, rel=1e-3))


def test_a_one_sided_bias_that_changes_nothing_is_not_a_parameter_difference():
    report = tblock_cli.check(Z + "BertNoKeyBias", like="hf:bert", only="like_reference", **SIZES)
    (r,) = report.checks
    assert (r.status.value, r.kind) == ("pass", "like_reference.same"), r.detail
    compared = tblock_cli.compare(Z + "BertNoKeyBias", "hf:bert", **SIZES)
    zeroed = [f.facts for f in compared.findings if f.kind == "mapping.bias_zeroed"]
    assert zeroed == [{"side": "B", "param": "layers.0.attention.self.key.bias", "inert": True}], zeroed
