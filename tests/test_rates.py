"""A block's randomness, dtypes and buffers against what it says and what torch's machinery assumes: an attention
dropout rate taken and never passed on fails dropout; masks from NumPy's stream are warned by checkpointing (torch's
checkpoint puts back only torch's streams); a float64 output from a float32 input fails shape; a buffer the backward
reaches fails grad_params; a parameter built narrower than the rest is warned by dtype."""

import pytest
import torch
import zoo_rates

import tblock_cli
from tblock_cli.checks import Status

from conftest import TESTS

BAD = {Status.WARN, Status.FAIL, Status.ERROR}


def run(name, **flags):
    return tblock_cli.check(f"{TESTS / 'zoo_rates.py'}:{name}", d_model=32, n_heads=4, threads=1, causal=True, **flags)


@pytest.mark.parametrize("name", sorted(zoo_rates.PLANTED))
def test_planted_is_caught_by_its_kind(name):
    kind = zoo_rates.PLANTED[name]
    c = run(name, only=kind.split(".")[0]).checks[0]
    assert c.kind == kind, (c.kind, c.detail)
    assert c.status is (Status.WARN if kind in zoo_rates.WARNED else Status.FAIL)


@pytest.mark.parametrize("name", zoo_rates.CORRECT)
def test_correct_twins_raise_no_alarm(name):
    report = run(name)
    assert not [c for c in report.checks if c.status in BAD], [(c.name, c.detail) for c in report.checks if c.status in BAD]


def test_the_ignored_rate_is_named_with_where_it_is_said():
    c = run("AttentionDropoutIgnored", only="dropout").checks[0]
    assert c.value == 0.1 and "attention_dropout" in c.facts["where"] and c.facts["attention_calls"] > 0, c.facts
    c = run("AttentionDropoutOnOutput", only="dropout").checks[0]
    assert "attn_drop" in c.facts["where"], c.facts


def test_a_rate_of_zero_says_nothing():
    c = run("AttentionDropoutIgnored", only="dropout", kwargs={"attention_dropout": 0.0}).checks[0]
    assert c.status is Status.PASS, c.detail


def test_numpy_masks_pass_once_numpy_is_put_back_and_fail_otherwise():
    """The emulated recompute with every stream put back reproduces the forward; with only torch's (as torch's own
    checkpoint does) it does not: the warning says which."""
    c = run("NumPyMasks", only="checkpointing").checks[0]
    assert "differs" in c.facts["what"] or "recompute saved" in c.facts["what"], c.facts


def test_a_numpy_table_cast_to_the_input_dtype_passes():
    class Cast(zoo_rates.NumPyTable):
        def ffn(self, h):
            return super(zoo_rates.NumPyTable, self).ffn(h) * torch.from_numpy(self.table).to(h)

    report = tblock_cli.check(Cast(32, 4), d_model=32, n_heads=4, threads=1, only="shape")
    assert report.checks[0].status is Status.PASS, report.checks[0].detail


def test_the_buffer_that_learns_is_named():
    report = run("LearnableBuffer", only="grad_params")
    assert report.checks[0].facts["buffers"] == ["gain"]


def test_the_narrow_parameter_is_named_with_its_dtype_and_the_blocks():
    c = run("GainBuiltInBfloat16", only="dtype").checks[0]
    assert c.facts["params"] == {"out_gain": "bfloat16"} and c.facts["block"] == "float32", c.facts


def test_a_cast_to_half_inside_is_named_where_it_happens_and_a_half_run_is_not_judged():
    c = run("SoftmaxInHalf", only="dtype").checks[0]
    assert (c.facts["call"], c.facts["wide"], c.facts["half"]) == ("half", "float32", "float16"), c.facts
    c = run("AutocastInside", only="dtype").checks[0]
    assert c.facts["half"] == "bfloat16" and c.facts["module"] == "w1" and c.facts["call"] == "linear", c.facts
    # run in bfloat16, the cast is the run's own precision
    c = run("SoftmaxInHalf", only="dtype", dtype="bfloat16").checks[0]
    assert c.kind != "dtype.narrowed", c.detail
