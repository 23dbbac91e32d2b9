"""A block with a torch.compile'd part (tests/zoo_compiled.py): the battery, the card and the FLOP trace read it as
they read its eager twin (before, eight checks raised dynamo's guard error: a NameError under tblock's modes)."""

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
