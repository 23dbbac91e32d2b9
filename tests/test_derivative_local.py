"""The derivative check where coarse finite differences agree with each other and not with autograd, though autograd
is right: a block that wiggles below the steps (tests/zoo_kinks.py), as a ReLU block kinks at every scale."""

import torch

from tblock_cli.checks import run_checks, training
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")


def derivative():
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_kinks.py'}:Wiggle")
    return run_checks(subject, cfg, CPU, torch.float32, only=("derivative",)).checks[0]


def test_derivative_reads_the_local_slope_where_coarse_steps_agree_on_another(monkeypatch):
    # the input-alone direction's coarse steps agree to ~5e-3 on the slope without the wiggle (0.27 from autograd);
    # autograd's is the local derivative, which two tiny steps confirm: the check passes, and fails without them
    c = derivative()
    assert c.kind == "derivative.matches", (c.kind, c.facts)
    monkeypatch.setattr(training, "LOCAL_AGREE", -1.0)
    c = derivative()
    assert c.kind == "derivative.wrong", (c.kind, c.facts)
    assert max(e["distance"] for e in c.facts["errors"]) > 0.1
