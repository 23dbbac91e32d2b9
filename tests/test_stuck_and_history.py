"""Two properties of a block across steps and calls: parameters an optimizer can move at all (optimizer_step's stuck
parameters, tests/zoo_init.py), and outputs that depend on the input and the module's state only, not on the calls
before (the history check, tests/zoo_history.py)."""

import pytest
import torch
import torch.nn as nn
import zoo_history
import zoo_init

from tblock_cli.checks import Status, run_checks
from tblock_cli.checks.optimizer import _stuck
from tblock_cli.checks.zeros import hiding_zeros
from tblock_cli.config import build_config
from tblock_cli.report import RunInfo
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(spec, only, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / spec}" if spec else None)
    return {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=only).checks}


ZEROS = {"ZeroGatedFFN": ["w1.weight", "w3.weight", "w2.weight"], "ZeroValueAndOutput": ["v_proj.weight", "o_proj.weight"],
         "ZeroQueryAndKey": ["q_proj.weight", "k_proj.weight"], "ZeroGateZeroBranch": ["alpha", "w2.weight"]}


@pytest.mark.parametrize("name", sorted(zoo_init.PLANTED))
def test_zeros_that_hold_each_others_gradient_are_named(name):
    c = run(f"zoo_init.py:{name}", ("optimizer_step",))["optimizer_step"]
    assert (c.status, c.kind) == (Status.FAIL, "optimizer_step.stuck"), c
    assert c.facts["zeros"] == ZEROS[name] and set(ZEROS[name]) <= set(c.facts["stuck"]), c.facts


@pytest.mark.parametrize("name", sorted(zoo_init.SYMMETRIC))
def test_hidden_units_in_identical_copies_are_counted(name):
    c = run(f"zoo_init.py:{name}", ("optimizer_step",))["optimizer_step"]
    assert (c.status, c.kind) == (Status.FAIL, "optimizer_step.symmetric_units"), c
    units, want = c.facts["units"], zoo_init.SYMMETRIC[name]
    assert c.facts["distinct"] == {"heads": 4, None: -(-units // 5)}.get(want, want), c.facts
    assert c.facts["where"] == ("attention's values" if want == "heads" else "the FFN"), c.facts


@pytest.mark.parametrize("name", zoo_init.CORRECT)
def test_zero_initialisations_that_train_raise_no_alarm_in_the_whole_battery(name):
    by = run(f"zoo_init.py:{name}", None)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]
    assert by["optimizer_step"].facts["stuck"] == []


@pytest.mark.parametrize("name", sorted(zoo_init.BEHIND_ZEROS))
def test_a_bug_behind_a_zero_init_is_caught_and_the_init_is_put_back(name):
    # at init the block is the identity: the outputs compared x with x. The battery draws the zero weights at random
    # (and says so), judges optimizer_step on them as built, and leaves the block as it found it
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_init.py'}:{name}")
    zeros = [n for n, p in subject.module.named_parameters() if not p.any()]
    check = zoo_init.BEHIND_ZEROS[name]
    report = run_checks(subject, cfg, CPU, torch.float32, only=(check, "optimizer_step"),
                        run=RunInfo("block", {}, {}))
    by = {c.name: c for c in report.checks}
    assert by[check].status is Status.FAIL, by[check]
    # as built, what the zeros multiply gets no gradient yet (as the draws, everything would)
    assert by["optimizer_step"].status is Status.PASS and by["optimizer_step"].facts["zero_grad"], by
    assert [n for n, p in subject.module.named_parameters() if not p.any()] == zeros
    assert any(all(n in w for n in zeros) and "drawn at random" in w for w in report.run.warnings), report.run.warnings


def test_checks_that_judge_the_init_alone_draw_nothing():
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_init.py'}:ZeroOutputProjections")
    report = run_checks(subject, cfg, CPU, torch.float32, only=("optimizer_step",), run=RunInfo("block", {}, {}))
    assert report.run.warnings == () and report.checks[0].facts["zero_grad"], report


def test_vectors_of_zeros_are_not_drawn():
    # a bias or a norm's offset adds to the stream rather than hiding it; a matrix and a single gate hide what they
    # multiply; frozen and integer tensors are not the init's
    m = nn.Module()
    m.bias, m.gate, m.w = (nn.Parameter(torch.zeros(s)) for s in ((8,), (1,), (4, 8)))
    m.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    m.live = nn.Parameter(torch.ones(4, 4))
    assert hiding_zeros(m) == ["gate", "w"]


def test_rezero_lowers_the_loss_measurably():
    # alpha = 0: one step of 1e-4 lowers the loss by ~1e-7 of it, under float32's resolution of a loss near 2; the
    # loss is summed in float64, so the decrease shows (it read as 'not lowered' when summed in float32)
    c = run("zoo_init.py:ReZero", ("optimizer_step",), d_model=64)["optimizer_step"]
    assert c.status is Status.PASS and c.facts["loss_after"] < c.facts["loss_before"], c.facts
    assert c.facts["loss_before"] - c.facts["loss_after"] < 1e-5 * c.facts["loss_before"]


def test_stuck_wakes_factors_of_a_product_but_not_a_gradient_zero_by_structure():
    a, b, k = (nn.Parameter(torch.zeros(4, 4)) for _ in range(3))
    x, target = torch.randn(3, 4), torch.randn(3, 4)

    def loss():  # x a b: each factor's gradient is the other; k times a constant 0: zero whatever k holds
        return ((x @ a @ b + 0.0 * k.sum()) - target).pow(2).mean().double()

    params = [("a", a), ("b", b), ("k", k)]
    stuck, zeros = _stuck(params, ["a", "b", "k"], loss)
    assert (sorted(stuck), sorted(zeros)) == (["a", "b"], ["a", "b"])
    assert not a.any() and not b.any() and not k.any()  # put back


def test_a_weight_kept_from_before_the_step_for_inference_calls_is_stale():
    """The step's own forwards run with gradients, which rebuild the kept matrix: only an eval call without them after
    the step sees the old q, k, v. The twin concatenates at every call."""
    c = run("zoo_history.py:FusedKeptForInference", ("optimizer_step",))["optimizer_step"]
    assert c.kind == "optimizer_step.stale" and c.facts["stale"] > 5 * c.facts["limit"], c
    ok = run("zoo_history.py:FusedInEval", ("optimizer_step",))["optimizer_step"]
    assert ok.kind == "optimizer_step.ok" and ok.facts["stale"] < 1e-6, ok.facts


@pytest.mark.parametrize("name", sorted(k for k, v in zoo_history.PLANTED.items() if v == "history"))
def test_an_output_that_depends_on_earlier_calls_fails_history(name):
    by = run(f"zoo_history.py:{name}", ("history",))
    c = by["history"]
    assert (c.status, c.kind) == (Status.FAIL, "history.differs"), c
    assert c.facts["diffs"][c.facts["worst"]] > c.facts["limit"]


@pytest.mark.parametrize("name", zoo_history.CORRECT)
def test_caches_that_follow_their_inputs_raise_no_alarm_in_the_whole_battery(name):
    by = run(f"zoo_history.py:{name}", None)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]
    assert by["history"].status is Status.PASS and set(by["history"].facts["diffs"]) == {"shorter", "longer", "padded", "standard"}


def test_history_compares_every_probe_in_two_orders_on_the_built_in_block():
    c = run(None, ("history",))["history"]
    assert c.status is Status.PASS and c.value == 0.0, c
    assert c.facts["order"]["block"][0] == "padded" and c.facts["order"]["fresh"][0] == "shorter"


class GrowingSavedTable(nn.Module):
    """A cos/sin table in persistent buffers that grow with the longest call: a fresh instance cannot load them."""

    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("table", torch.zeros(0, d_model))

    def forward(self, x):
        T = x.shape[1]
        if self.table.shape[0] < T:
            self.table = torch.arange(T, dtype=x.dtype)[:, None].expand(T, x.shape[-1]).sin().clone()
        return x + self.proj(x) * self.table[:T]


def test_history_skips_where_a_fresh_instance_cannot_load_the_blocks_tensors():
    import tblock_cli

    (c,) = tblock_cli.check(GrowingSavedTable, d_model=32, n_heads=4, threads=1, only="history").checks
    assert (c.status, c.kind) == (Status.SKIP, "history.unloadable") and "loading state_dict" in c.facts["error"], c


def test_a_frozen_weight_is_a_slip_and_a_frozen_table_of_its_own_name_is_a_design():
    from tblock_cli.checks.optimizer import frozen_slips

    class Gain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.ones(4))

    m = torch.nn.Module()
    m.norm, m.table = torch.nn.LayerNorm(4), torch.nn.Embedding(8, 4)
    m.a, m.b = Gain(), Gain()
    m.pos = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)  # a fixed sin-cos table (MAE's pos_embed)
    m.table.weight.requires_grad_(False)  # a sinusoidal embedding frozen on purpose
    assert frozen_slips(m) == []
    m.norm.weight.requires_grad_(False)
    m.b.gamma.requires_grad_(False)  # its sibling a.gamma trains
    assert frozen_slips(m) == ["norm.weight", "b.gamma"]
