"""Hand-written backwards written for a contiguous gradient (tests/zoo_backward.py): the derivative check's float64
step hands the block a gradient laid out in reverse, as a transpose after the block does."""

import pytest
import torch
import zoo_backward

from tblock_cli.checks import Status, run_checks
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(name, only):
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, torch.device("cpu"), torch.float32, f"{TESTS / 'zoo_backward.py'}:{name}")
    return {c.name: c for c in run_checks(subject, cfg, torch.device("cpu"), torch.float32, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_backward.PLANTED))
def test_a_backward_written_for_a_contiguous_gradient_is_caught_by_the_derivative(name):
    # the float64 step's gradient arrives laid out in reverse: .view raises there (and not on the contiguous
    # gradient: derivative.layout), memory read as contiguous differs from the finite differences (derivative.wrong)
    c = run(name, ("derivative",))["derivative"]
    want = {"ViewedGradient": "derivative.layout", "StridesIgnored": "derivative.wrong",
            "BiasInBackwardOnly": "derivative.wrong"}[name]
    assert c.status is Status.FAIL and c.kind == want, c
    if name == "BiasInBackwardOnly":  # flat at every size: no rounding's surrogate, named
        assert c.facts["tensor"] == "w2.bias", c
    twin = run(zoo_backward.CORRECT[0], None)
    assert not [c for c in twin.values() if c.status in BAD], [(c.name, c.detail) for c in twin.values() if c.status in BAD]
