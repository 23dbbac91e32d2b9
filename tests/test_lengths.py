"""The length probes: `shape` on one token, `causal` on a prefix alone. Planted length bugs (tests/zoo_length.py)
caught by the check meant for them, the correct twins clean in the whole battery, and the prefix finding against
the block run by hand: its first tokens alone, with the scale it has and with the scale fixed."""

import math

import pytest
import torch
import zoo_length
import zoo_training

import tblock_cli
from tblock_cli.checks import Status

from conftest import TESTS

BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def checks(name, only=None, **flags):
    spec = f"{TESTS / 'zoo_length.py'}:{name}"
    r = tblock_cli.check(spec, d_model=32, n_heads=4, causal=True, threads=1, only=only, **flags)
    return {c.name: c for c in r.checks}


@pytest.mark.parametrize("name", sorted(zoo_length.PLANTED))
def test_a_length_bug_is_caught_by_its_check(name):
    check, kind = zoo_length.PLANTED[name]
    c = checks(name, only=check)[check]
    assert c.status is Status.FAIL and c.kind == kind, c


@pytest.mark.parametrize("name", zoo_length.CORRECT)
def test_length_twins_raise_no_alarm_in_the_whole_battery(name):
    bad = [(c.name, c.kind) for c in checks(name).values() if c.status in BAD]
    assert not bad, bad


def test_a_one_token_failure_leaves_the_other_checks_their_shape():
    by = checks("SqueezedGate", only="shape,finite")
    assert by["shape"].kind == "shape.one_token" and by["shape"].facts["input"] == [2, 1, 32]
    assert by["finite"].status is Status.PASS  # runs: the shape need of the standard sequence is met


def test_a_block_that_raises_on_one_token_warns_with_its_error():
    class NeedsTwo(torch.nn.Module):
        def forward(self, x):
            if x.shape[1] < 2:
                raise ValueError("at least two tokens")
            return x * 1.0
    c = tblock_cli.check(NeedsTwo(), d_model=16, n_heads=2, only="shape").checks[0]
    assert c.status is Status.WARN and c.kind == "shape.one_token_raises" and "at least two" in c.facts["error"]


def test_the_prefix_finding_is_the_block_run_alone_on_its_first_tokens():
    # ScaleByKeyCount's first token alone sees one key: a softmax over one key is 1 whatever the scale, so t = 0
    # agrees; the first half (positions 0..5) run alone is scaled by 1/sqrt(6), not 1/sqrt(10), and is named
    c = checks("ScaleByKeyCount", only="causal")["causal"]
    assert c.facts["t"] == 5 and c.facts["diff"] > 1e-3
    block = zoo_length.ScaleByKeyCount(32, 4).eval()
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        whole, half = block(x)[:, :6], block(x[:, :6])
        assert not torch.allclose(whole, half, atol=1e-5)
        # the same block with the scale fixed at sqrt(d_head) is prefix-consistent
        block.attention = lambda h: zoo_training.attend(block, h, scale=1 / math.sqrt(8))
        assert torch.allclose(block(x)[:, :6], block(x[:, :6]), atol=1e-5)


def test_half_precision_rounding_that_flips_a_top_k_is_not_a_length_read():
    """bfloat16 rounds a sequence's scores and its prefix's differently (rows of other lengths), and a top-4 over
    near-tied keys picks others: 0.05 apart while the block reads no length. A float64 copy agrees, so causal passes;
    a scale by the key count differs in float64 too and still fails."""
    spec = f"{TESTS / 'zoo_attention.py'}:TopKAttention"
    topk = tblock_cli.check(spec, d_model=64, n_heads=4, causal=True, threads=1, dtype="bfloat16", only="causal").checks[0]
    assert topk.status is Status.PASS, topk
    scaled = checks("ScaleByKeyCount", only="causal", dtype="bfloat16")["causal"]
    assert scaled.status is Status.FAIL and scaled.kind == "causal.prefix", scaled
