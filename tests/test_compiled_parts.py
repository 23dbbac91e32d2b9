"""Blocks whose parts torch runs its own way (tests/zoo_compiled.py). A torch.compile'd part: the battery, the card and
the FLOP trace read it as they read its eager twin (before, eight checks raised dynamo's guard error: a NameError under
tblock's modes). FlexAttention on the CPU, which has no backward there: the checks that need gradients skip saying so,
the others judge its forwards (before, nine checks raised and the rest skipped as if the forward wrote its input)."""

import pytest
import torch

import tblock_cli
from tblock_cli.checks import Status

from conftest import TESTS

BLOCK = f"{TESTS / 'zoo_compiled.py'}"
FLAGS = {"d_model": 32, "n_heads": 4, "threads": 1, "causal": True}


def test_the_whole_battery_is_clean_and_reads_what_the_eager_twin_reads():
    compiled = tblock_cli.check(f"{BLOCK}:CompiledFFN", **FLAGS)
    bad = [(c.name, c.detail) for c in compiled.checks if c.status in (Status.FAIL, Status.ERROR, Status.WARN)]
    assert not bad, bad
    eager = tblock_cli.check(f"{BLOCK}:EagerFFN", **FLAGS)
    assert [(c.name, c.status, c.kind) for c in compiled.checks] == [(c.name, c.status, c.kind) for c in eager.checks]


def test_the_card_and_the_flops_equal_the_eager_twins():
    card = {e.key: e.value for e in tblock_cli.spec(f"{BLOCK}:CompiledFFN", **FLAGS).card.entries}
    eager = {e.key: e.value for e in tblock_cli.spec(f"{BLOCK}:EagerFFN", **FLAGS).card.entries}
    assert card == eager and card["ffn.act"] == "silu", (card, eager)
    flops = tblock_cli.params(f"{BLOCK}:CompiledFFN", **FLAGS).flops
    assert flops == tblock_cli.params(f"{BLOCK}:EagerFFN", **FLAGS).flops and flops["forward"] > 0
    assert "torch._dynamo" in __import__("sys").modules and torch.compiler.is_compiling() is False


def test_a_kernel_without_a_backward_here_skips_the_gradient_checks_and_judges_the_forwards():
    pytest.importorskip("torch.nn.attention.flex_attention")
    report = tblock_cli.check(f"{BLOCK}:FlexBlock", **FLAGS)
    by = {c.name: c for c in report.checks}
    assert not [c.name for c in report.checks if c.status in (Status.FAIL, Status.ERROR, Status.WARN)]
    for name in ("grad_input", "grad_params", "residual", "batch", "causal", "derivative", "optimizer_step"):
        assert by[name].kind == "needs.backward" and "FlexAttention" in by[name].facts["error"], by[name]
        assert "backward does not run on this device" in by[name].detail
    for name in ("shape", "finite", "determinism", "dtype", "norm_placement", "state_dict"):
        assert by[name].status is Status.PASS, by[name]
