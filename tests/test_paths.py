"""Paths a gradient takes (tests/zoo_paths.py): a parameter whose gradient is exactly zero where the output moves with
it (a rounding with no straight-through) is caught by `grad_params`, as is a router no gradient reaches; experts no
token of the probe was routed to are the data's path, in `grad_params` and in `train_eval`."""

import pytest
import torch
import zoo_paths

from tblock_cli.checks import Status, run_checks
from tblock_cli.checks.paths import scattered
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")


def run(name, only, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, "causal": True, **flags})
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_paths.py'}:{name}")
    return {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_paths.PLANTED))
def test_a_path_no_gradient_takes_is_caught_and_named(name):
    check, kind = zoo_paths.PLANTED[name]
    c = run(name, (check,))[check]
    assert c.status is Status.FAIL and c.kind == kind, c
    if name == "RouterOnlyPicks":  # the experts no token chose are reached by other inputs: only the router is named
        assert c.facts["params"] == ["router.weight"]
    if kind == "grad_params.piecewise":
        assert all(c.facts["moves"][n] > c.facts["limit"] for n in c.facts["params"])


def test_the_twins_pass_grad_params_and_train_eval():
    by = run("QuantisedFFN", ("grad_params", "train_eval"))
    assert by["grad_params"].kind == "grad_params.ok" and by["train_eval"].status is Status.PASS
    by = run("SparseMoE", ("grad_params", "train_eval"))
    assert by["grad_params"].kind in ("grad_params.ok", "grad_params.routed_path"), by["grad_params"]
    assert by["train_eval"].status is Status.PASS, by["train_eval"]
    # the eval graph itself, read as train_eval reads it: dropout's draws moved the training step's routing, a
    # dropout-free training forward reaches what eval does, so no parameter is an eval-only path's
    from tblock_cli.checks.context import Context
    from tblock_cli.checks.structure import eval_unused

    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_paths.py'}:SparseMoE")
    ctx = Context(subject, cfg, CPU, torch.float32)
    assert eval_unused(ctx, ctx.x())[0] == []


def test_zeros_scattered_over_rows_and_columns_are_a_rounding_and_whole_zero_rows_or_columns_are_units_nothing_reached():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=gen)
    per_row = torch.ones(64, 64, dtype=torch.bool).scatter_(1, w.abs().argmax(1, keepdim=True), False)  # a row's scale
    per_tensor = torch.ones(64, 64, dtype=torch.bool)
    per_tensor[3, 5] = False  # one scale for the tensor: its largest element alone learns
    router_rows = torch.zeros(64, 64, dtype=torch.bool)
    router_rows[20:] = True  # (experts, d): the rows of 44 experts no token chose
    assert scattered(per_row) and scattered(per_tensor)
    assert not scattered(router_rows) and not scattered(router_rows.t().contiguous())  # (d, experts) as x @ w_gate
