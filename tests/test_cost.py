"""Each check's cost in passes over the block: counted by hooks that copies carry, held to its recorded budget."""

import copy
from pathlib import Path

import torch
import torch.nn as nn

import tblock_cli
from tblock_cli.checks.battery import CHECK_NAMES
from tblock_cli.checks.cost import BUDGET, PassCounter, budget_table


def test_counter_counts_forwards_backwards_and_a_copys_passes_without_a_module_hook():
    from tblock_cli.subject.loading import Subject

    m = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    subject = Subject(m, "layer", False, None, False)
    counter = PassCounter(subject)
    x = torch.randn(2, 3, 8)
    subject(x.requires_grad_()).sum().backward()
    with torch.no_grad():
        subject(x)
    subject.like(copy.deepcopy(m))(x).sum().backward()  # a check's copy: its passes are the check's cost too
    got = counter.now()
    assert (got.forward, got.backward, got.equivalents) == (3, 2, 7)
    assert not m._forward_hooks and not m._forward_pre_hooks  # the fast path of nn.TransformerEncoderLayer stays on
    counter.close()
    subject(x)
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


def test_cached_decoding_steps_count_as_forwards():
    from tblock_cli.checks.attention import AFTER_PROMPT

    report = tblock_cli.check(d_model=32, n_heads=4, threads=1, causal=True, only=["kv_cache"])
    (c,) = report.checks
    assert c.status == "pass", c
    # two sequences: the prompt, then AFTER_PROMPT tokens one at a time, or in chunks of 3
    steps = (1 + AFTER_PROMPT) + (1 + -(-AFTER_PROMPT // 3))
    full = c.passes.forward - steps  # the full causal forwards they are compared with: one batched, or one each
    assert full in (1, 2), (c.passes, steps)
