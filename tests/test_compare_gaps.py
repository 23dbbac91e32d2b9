"""Three things `tblock compare` says beyond one forward's captures: a parameter only one side has, left at its
identity init and said; a fused q/k/v projection split in another order, named with the order; a difference only on
the cached (decode) path, localised to its step and component."""

import pytest

import tblock_cli
from tblock_cli.errors import ConfigError

from conftest import TESTS

G = f"{TESTS / 'compare_gaps_blocks.py'}:"
SIZES = {"d_model": 32, "n_heads": 4, "seq": 8, "threads": 1}
# with the other transformers tests (tests/test_hf.py): the import is paid once
pytestmark = pytest.mark.xdist_group("hf")


def kinds(report, kind):
    return [f.facts for f in report.findings if f.kind == kind]


@pytest.mark.parametrize("a, b, side", [("QKNormBlock", "WeightedQKNorm", "B"), ("WeightedQKNorm", "QKNormBlock", "A")])
def test_a_weighted_qk_norm_against_a_weight_free_one_is_carried_and_said(a, b, side):
    """B's q/k-norm weights (ones, as initialised) have no counterpart in A: left as they are, where they compute
    the identity, so the two blocks are one function; said as a finding."""
    blocks = {"QKNormBlock": G + "QKNormBlock", "WeightedQKNorm": G + "QKNormBlock"}
    kw = {"QKNormBlock": {}, "WeightedQKNorm": {"weighted": True}}
    report = tblock_cli.compare(blocks[a], blocks[b], kwargs_a=kw[a], kwargs_b=kw[b], **SIZES)
    assert report.ok, [f.text for f in report.findings]
    said = kinds(report, "mapping.at_init")
    assert {(f["side"], f["param"], f["value"]) for f in said} == {(side, "q_norm.weight", "ones"),
                                                                     (side, "k_norm.weight", "ones")}


@pytest.mark.parametrize("whole", [False, True])
def test_a_weight_free_qk_norm_against_hf_qwen3(whole):
    """hf:qwen3's q/k-norm weights (ones at init) against a port that norms without a weight: carried and said;
    per head the two are one function, over the whole projection they are not."""
    pytest.importorskip("transformers")
    report = tblock_cli.compare(G + "ScratchQwen3", "hf:qwen3", kwargs_a={"n_kv_heads": 2, "whole": whole},
                                kwargs_b={"num_key_value_heads": 2}, **SIZES)
    said = {f["param"].rsplit(".", 2)[-2] for f in kinds(report, "mapping.at_init") if f["side"] == "B"}
    assert said == {"q_norm", "k_norm"}
    assert report.ok is not whole, [f.text for f in report.findings]


def test_an_extra_weight_away_from_its_identity_is_still_refused_with_why():
    with pytest.raises(ConfigError, match="q_norm.weight .*not at the identity"):
        tblock_cli.compare(G + "QKNormBlock", G + "QKNormBlock", kwargs_b={"weighted": True, "trained": True}, **SIZES)


@pytest.mark.parametrize("a, kw_a, b, kw_b, side, order", [
    ("FusedQKV", {"order": "kqv"}, "SeparateQKV", {}, "A", "k, q, v"),
    ("FusedQKV", {"order": "vkq"}, "SeparateQKV", {}, "A", "v, k, q"),
    ("SeparateQKV", {}, "FusedQKV", {"order": "qvk"}, "B", "q, v, k"),
])
def test_a_fused_qkv_split_in_another_order_is_named_with_the_order(a, kw_a, b, kw_b, side, order):
    report = tblock_cli.compare(G + a, G + b, kwargs_a=kw_a, kwargs_b=kw_b, **SIZES)
    assert not report.ok
    facts = report.first_difference.facts
    assert facts["fused_order"] == {"side": side, "params": ["c_attn.bias", "c_attn.weight"], "order": order}
    assert report.first_difference.text.startswith(f"first difference: fused q/k/v split in order {order}")


@pytest.mark.parametrize("order", ["kqv", "vqk"])
def test_a_fused_qkv_split_order_against_hf_gpt2(order):
    """Both sides fused (GPT-2's Conv1D c_attn read transposed, its bias carried whole by name and split alike)."""
    pytest.importorskip("transformers")
    report = tblock_cli.compare(G + "ScratchGPT2", "hf:gpt2", kwargs_a={"order": order}, **SIZES)
    facts = report.first_difference.facts
    assert facts["fused_order"] == {"side": "A", "params": ["c_attn.bias", "c_attn.weight"], "order": ", ".join(order)}
    assert tblock_cli.compare(G + "ScratchGPT2", "hf:gpt2", **SIZES).ok


def test_a_fused_qkv_in_the_usual_order_is_equal_and_no_order_is_named():
    report = tblock_cli.compare(G + "FusedQKV", G + "SeparateQKV", **SIZES)
    assert report.ok and report.first_difference is None


def test_an_unrelated_difference_is_not_called_a_split_order():
    """Rows taken in another order do not explain a q/k-norm and a causal mask on B: no order makes them agree."""
    report = tblock_cli.compare(G + "FusedQKV", G + "QKNormBlock", **SIZES)
    assert not report.ok
    assert "fused_order" not in (report.first_difference.facts if report.first_difference else {})


def test_a_difference_on_the_decode_path_only_is_localised_to_its_step_and_component():
    """B rotates each decoded token from position 0: the full forward agrees, the first single-token step (position
    seq/2) differs, first at the queries attention reads (after rotary)."""
    report = tblock_cli.compare(G + "CachedRope", G + "CachedRope", kwargs_b={"decode_offset_bug": True}, **SIZES)
    by_name = {c.name: c for c in report.comparisons}
    assert by_name["outputs"].equal and not by_name["decode"].equal
    facts = report.first_difference.facts
    assert facts["path"] == "decode" and facts["step"] == 1 and facts["positions"] == [4, 4]
    assert facts["component"] == "attn.q_pos#0"
    assert "cached path only: decode step 1 (position 4)" in report.first_difference.text


def test_equal_decoding_blocks_stay_equal():
    report = tblock_cli.compare(G + "CachedRope", G + "CachedRope", **SIZES)
    assert report.ok and {c.name for c in report.comparisons} >= {"outputs", "decode"}


def test_a_decode_only_bug_against_hf_llama_is_localised_through_its_own_cache():
    """Each side decodes from a copy of its own cache (HF's DynamicCache for hf:llama) at the step that differs."""
    pytest.importorskip("transformers")
    gqa = {"kwargs_b": {"num_key_value_heads": 2}}
    good = tblock_cli.compare(G + "DecodingLlama", "hf:llama", kwargs_a={"n_kv_heads": 2}, **gqa, **SIZES)
    bad = tblock_cli.compare(G + "DecodingLlama", "hf:llama", kwargs_a={"n_kv_heads": 2, "decode_offset_bug": True},
                             **gqa, **SIZES)
    assert good.ok, [f.text for f in good.findings]
    facts = bad.first_difference.facts
    assert (facts["path"], facts["step"], facts["component"]) == ("decode", 1, "attn.q_pos#0")
