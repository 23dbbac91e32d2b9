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
    if name == "UpHalfUnread":  # the up half: the second half of w1's output rows, derived from the chunk
        hidden = 2 * int(8 * 32 / 3)
        assert c.facts["slices"] == {"w1.weight": ("rows", hidden // 2, hidden)}
    if name == "OneHeadOfWideKeys":  # of 32 output rows, one head's 8 are read
        assert c.facts["slices"] == {"k_proj.weight": ("rows", 24, 32), "v_proj.weight": ("rows", 24, 32)}


@pytest.mark.parametrize("name", ["FusedGateUp", "AdaLNZero", "PrunedUnits", "DenseExperts", "SparseActivations",
                                  "OneHotPositions"])
def test_zero_rows_that_other_inputs_or_parameters_revive_or_that_are_no_outputs_pass(name):
    c = run(name, ("grad_params",))["grad_params"]
    assert c.kind == "grad_params.ok", c


def test_which_axis_of_a_matrix_is_a_products_output():
    from tblock_cli.checks.paths import multiplied

    lin = torch.nn.Linear(8, 6)  # F.linear: addmm(bias, x, weight.t()): the weight's rows are outputs
    table = torch.nn.Parameter(torch.randn(5, 8))  # x @ table: its columns; one-hot @ table: its columns too
    right = torch.nn.Parameter(torch.randn(8, 3))
    x = torch.randn(2, 4, 8)
    out = lin(x).sum() + (x @ right).sum() + (torch.eye(5)[:4] @ table).sum() + (table[0] * 2).sum()
    found = multiplied(out)
    assert found[id(lin.weight)] == "rows" and found[id(right)] == "columns"
    assert id(table) not in found  # also indexed: not only a product's operand
    assert id(lin.bias) not in found  # added, not multiplied
    with torch.autocast("cpu", dtype=torch.bfloat16):  # through autocast's cast
        assert multiplied(lin(x))[id(lin.weight)] == "rows"


def test_a_straight_through_estimators_surrogate_is_no_wrong_backward():
    c = run("RoundedGateSTE", ("derivative",))["derivative"]
    assert c.status is Status.PASS and c.kind == "derivative.surrogate" and c.facts["tensors"] == ["gate"], c


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
