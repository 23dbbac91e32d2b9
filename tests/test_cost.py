"""Each check's cost in passes over the block: counted by hooks that copies carry, held to its recorded budget."""

import copy
from pathlib import Path

import torch
import torch.nn as nn

import tblock_cli
from tblock_cli.checks.battery import CHECK_NAMES
from tblock_cli.checks.cost import BUDGET, PassCounter, budget_table


def test_counter_counts_forwards_backwards_and_a_deep_copys_passes():
    m = nn.Linear(4, 4)
    counter = PassCounter(m)
    x = torch.randn(2, 4)
    m(x).sum().backward()
    with torch.no_grad():
        m(x)
    copy.deepcopy(m)(x).sum().backward()  # a check's copy: its passes are the check's cost too
    got = counter.now()
    assert (got.forward, got.backward, got.equivalents) == (3, 2, 7)
    counter.close()
    m(x)
    assert counter.now().forward == 3


def test_every_check_stays_within_its_budget_and_the_battery_adds_up():
    report = tblock_cli.check(d_model=32, n_heads=4, threads=1)
    over = {c.name: (c.passes.equivalents, BUDGET.get(c.name)) for c in report.checks
            if c.passes is not None and c.passes.equivalents > BUDGET.get(c.name, -1)}
    assert not over, f"checks over their budget (count, budget): {over}; a new probe is a decision: raise BUDGET"
    assert report.passes.equivalents == sum(c.passes.equivalents for c in report.checks if c.passes is not None)
    assert set(BUDGET) == set(CHECK_NAMES)


def test_docs_budget_table_is_the_budget():
    docs = (Path(__file__).parent.parent / "docs" / "performance.md").read_text()
    assert budget_table() in docs, "docs/performance.md's budget table differs: paste checks.cost.budget_table()"
