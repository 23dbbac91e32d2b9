"""The global_state check: torch's process-wide switches and random streams a block's forward (or constructor) leaves
changed, judged on tests/zoo_global.py's planted bugs and correct twins; the battery puts every switch back. And
determinism's warning on module state an eval forward writes at every call."""

import random

import pytest
import torch
import zoo_global

import tblock_cli
from tblock_cli.checks import globalstate

from conftest import TESTS

BAD = {"fail", "warn", "error"}


def battery(name, only=("global_state",), **flags):
    report = tblock_cli.check(f"{TESTS / 'zoo_global.py'}:{name}", d_model=32, n_heads=4, threads=1, only=only, **flags)
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("name", sorted(zoo_global.PLANTED))
def test_planted_leak_is_caught_and_the_process_left_as_it_was(name):
    before = globalstate.snapshot()
    c = battery(name)["global_state"]
    assert c.kind == zoo_global.PLANTED[name], (c.kind, c.facts)
    assert c.status.value == ("warn" if c.kind == "global_state.switched" else "fail")
    assert globalstate.snapshot() == before  # the run put every switch back: the caller's process is untouched


def test_the_leak_is_named_with_both_values_and_when():
    c = battery("Float64Default")["global_state"]
    assert c.facts["changed"]["default dtype"] == {"check": "build", "before": "torch.float32", "after": "torch.float64"}
    c = battery("GradOffInEval")["global_state"]
    assert c.facts["changed"]["grad mode"]["before"] == "True" and c.facts["changed"]["grad mode"]["after"] == "False"
    assert "grad mode True -> False" in c.detail


def test_reseeding_is_told_by_stream_and_mode():
    assert battery("ReseedsInTraining")["global_state"].facts["reseeds"] == {"train": ["torch"]}
    assert battery("SetSeedInEval")["global_state"].facts["reseeds"] == {"eval": ["torch", "python", "numpy"]}


def test_a_module_switched_by_the_forward_is_named_with_the_mode_it_happened_in():
    assert battery("DropoutOffInTraining")["global_state"].facts["modes"] == {"train": ["drop"]}
    c = battery("DropoutOnInEval")["global_state"]
    assert c.facts["modes"] == {"eval": ["drop"]} and "drop in an eval forward" in c.detail


# What a correct twin may be told: a layer skip drawn from Python's stream is drawn anew in torch's checkpoint's recompute
TOLD = {"PythonLayerDrop": {"checkpointing": "checkpointing.host_streams"}}


@pytest.mark.parametrize("name", zoo_global.CORRECT)
def test_correct_twin_raises_no_alarm_in_the_whole_battery(name):
    by = battery(name, only=None, causal=True)
    assert by["global_state"].kind == "global_state.kept", by["global_state"].facts
    told = TOLD.get(name, {})
    assert {c: by[c].kind for c in told} == told
    bad = [(c.name, c.detail) for c in by.values() if c.status.value in BAD and c.name not in told]
    assert not bad, bad


def test_the_callers_random_streams_are_where_they_were():
    torch.manual_seed(3)
    random.seed(3)
    expected = (torch.rand(1).item(), random.random())
    torch.manual_seed(3)
    random.seed(3)
    battery("ReseedsInTraining")
    assert (torch.rand(1).item(), random.random()) == expected


def test_a_switch_changed_inside_one_check_is_put_back_before_the_next():
    # the eval-only leak of GradOffInEval turns grad mode off inside the first check that runs an eval forward with
    # grad on; every later check still starts from grad mode on, so the training checks run and name their own result
    by = battery("GradOffInEval", only=None, causal=True)
    assert by["global_state"].kind == "global_state.changed"
    assert by["grad_params"].status.value == "pass", by["grad_params"].detail


def test_switches_restore_to_their_values():
    before = globalstate.snapshot()
    try:
        torch.set_float32_matmul_precision("medium")
        torch.set_grad_enabled(False)
        # the matmul precision moves TF32 for CUDA matmuls with it: both are read
        assert set(globalstate.changes(before, globalstate.snapshot())) == {"float32 matmul precision",
                                                                           "cuda matmul allow_tf32", "grad mode"}
        assert globalstate.severe(["float32 matmul precision", "grad mode"]) == ["grad mode"]
    finally:
        globalstate.restore(before)
    assert globalstate.snapshot() == before and torch.is_grad_enabled()


@pytest.mark.parametrize("name", zoo_global.WRITES_IN_EVAL)
def test_state_written_at_every_eval_call_is_a_warning_that_names_it(name):
    c = battery(name, only=("determinism",))["determinism"]
    assert c.kind == "determinism.writes_state", (c.kind, c.facts)
    assert c.status.value == "warn"
    if name == "EvalRunningMean":
        assert (c.facts["written"], c.facts["grown"]) == (["running_mean"], [])
    else:  # one more input kept per call: the path of the one the last call added
        assert c.facts["written"] == [] and len(c.facts["grown"]) == 1 and c.facts["grown"][0].startswith("seen[")


def test_a_hook_registered_at_every_call_is_a_warning_that_names_its_module():
    c = battery("HookPerCall", only=("determinism",))["determinism"]
    assert (c.status.value, c.kind, c.facts["added"]) == ("warn", "determinism.adds_hooks", {"o_proj": 1}), c.facts


def test_a_block_drawing_from_pythons_stream_gets_the_same_verdicts_whatever_the_callers_state():
    """tblock seeds Python's and NumPy's streams wherever it seeds torch's: the checks that compare two seeded runs
    (checkpointing, grad_accumulation, derivative) see the same skips drawn, and the caller's stream is put back."""
    got = []
    for seed in range(4):
        random.seed(seed)
        got.append({n: (c.status.value, c.kind) for n, c in battery("PythonLayerDrop", only=None).items()})
        assert random.random() == (random.seed(seed), random.random())[1]
    assert all(g == got[0] for g in got), [{n: v for n, v in g.items() if v != got[0][n]} for g in got]


def test_a_parameter_skipped_only_in_the_step_read_is_a_random_path_and_one_never_given_a_gradient_is_missing():
    c = battery("SkipsFirstStep", only=("grad_params",))["grad_params"]
    assert (c.status.value, c.kind) == ("pass", "grad_params.random_path"), c.detail
    assert {"q_proj.weight", "attn_norm.weight"} <= set(c.facts["params"])
    c = battery("WeightGradDropped", only=("grad_params",))["grad_params"]
    assert (c.status.value, c.kind, c.facts["params"]) == ("fail", "grad_params.missing", ["w2.weight"]), c.detail
