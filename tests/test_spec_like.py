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
