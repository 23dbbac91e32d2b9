"""Numerics and construction only training shows (tests/zoo_numerics.py): each planted bug caught by the check that
names it, each correct twin (and the designs earlier versions mistook for bugs) clean in the whole battery; and the
properties the new probes read, tested on their own."""

import pytest
import torch
import torch.nn as nn
import zoo_numerics

from tblock_cli.checks import Status, run_checks
from tblock_cli.checks.context import all_finite
from tblock_cli.checks.gradients import gain_of, on_sphere
from tblock_cli.checks.optimizer import aliased
from tblock_cli.checks.structure import shared_norms
from tblock_cli.config import build_config
from tblock_cli.probes import module_copy
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}
WARNINGS = {"attention.saturated", "norm_placement.shared", "optimizer_step.repeated"}


def run(spec, only, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / spec}")
    return {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_numerics.PLANTED))
def test_each_planted_bug_is_caught_by_the_check_that_names_it(name):
    check, kind = zoo_numerics.PLANTED[name]
    c = run(f"zoo_numerics.py:{name}", (check,))[check]
    assert c.kind == kind and c.status is (Status.WARN if kind in WARNINGS else Status.FAIL), (c.status, c.kind, c.detail)


@pytest.mark.parametrize("name", zoo_numerics.CORRECT)
def test_correct_twins_raise_no_alarm_in_the_whole_battery(name):
    by = run(f"zoo_numerics.py:{name}", None)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_nan_gradients_name_the_projections_they_reach():
    c = run("zoo_numerics.py:NaNHiddenByNanToNum", ("padding",))["padding"]
    # the NaN rows' scores come from q and k; v and the FFN see only the zeroed weights
    assert {"q_proj.weight", "k_proj.weight"} <= set(c.facts["params"]) and "w2.weight" not in c.facts["params"], c.facts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_wherever_the_odd_value_sits(dtype):
    # the one-pass min/max reading against the elementwise one: NaN, +inf and -inf alone and together, at the first,
    # a middle and the last element; finite values at the dtype's extremes (whose sum would overflow) pass
    big = torch.full((64, 33), torch.finfo(dtype).max, dtype=dtype)
    assert all_finite(big) and all_finite(-big) and all_finite(torch.zeros(0, dtype=dtype))
    for odd in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")], [float("nan"), 1.0]):
        for at in (0, 1000, 64 * 33 - 1):
            t = torch.randn(64, 33).to(dtype)
            flat = t.view(-1)
            for k, v in enumerate(odd):
                flat[(at + 7 * k) % flat.numel()] = v
            assert all_finite(t) == bool(torch.isfinite(t).all()) is False, (odd, at)
    assert all_finite(torch.arange(5))  # integers are finite


def test_an_overflowing_softmax_passes_once_it_subtracts_its_maximum():
    bad = run("zoo_numerics.py:NaiveSoftmax", ("attention",))["attention"]
    good = run("zoo_numerics.py:StableHandSoftmax", ("attention",))["attention"]
    assert bad.status is Status.FAIL and good.status is Status.PASS, (bad.detail, good.detail)


def test_aliased_finds_overlapping_storage_but_not_a_tie_or_separate_copies():
    a, b, c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    m = nn.ModuleDict({"a": a, "b": b, "c": c})
    assert aliased(m) == []
    b.weight = a.weight  # a tie: one Parameter
    assert aliased(m) == []
    c.weight.data = a.weight.data  # a second Parameter on the same storage
    assert aliased(m) == [["a.weight", "c.weight"]]
    half = nn.Module()
    half.whole = nn.Parameter(torch.randn(8))
    half.tail = nn.Parameter(half.whole.data[4:])  # a view: overlapping, not equal spans
    half.copy = nn.Parameter(half.whole.data[4:].clone())
    assert aliased(half) == [["whole", "tail"]]


def test_on_sphere_reads_one_norm_per_token():
    y = torch.randn(2, 5, 16, dtype=torch.float64)
    assert on_sphere(torch.nn.functional.normalize(y, dim=-1) * 3)
    assert not on_sphere(y)
    assert not on_sphere(torch.zeros(2, 5, 16))  # all zero: no sphere
    assert gain_of(y, 2 * y) == pytest.approx(2.0)
    for dtype in (torch.float16, torch.bfloat16):  # unit vectors rounded to half precision still read as a sphere
        y = torch.randn(4, 64, 64)
        assert on_sphere(torch.nn.functional.normalize(y, dim=-1).to(dtype)) and not on_sphere(y.to(dtype))


def test_shared_norms_lists_every_name_of_one_module():
    block = zoo_numerics.SharedNorm(32, 4)
    assert shared_norms(block, ["attn_norm", "ffn_norm"]) == [["attn_norm", "ffn_norm"]]
    assert shared_norms(zoo_numerics.TrainBlock(32, 4), ["attn_norm", "ffn_norm"]) == []


def test_parameters_between_the_projections_and_the_scores_count_as_attention():
    from tblock_cli.anatomy import trace

    block = zoo_numerics.ConvolvedQKV(32, 4)
    flow = trace(block, block, torch.randn(2, 6, 32), 32)
    roles = {m.name: m.role for m in flow.modules}
    assert [roles[f"convs.{i}"] for i in range(3)] == ["attn.inner"] * 3 and roles["q_proj"] == "attn.q"
    groups = flow.group_params()
    convs = sum(p.numel() for p in block.convs.parameters())
    assert groups["other"] == 0 and groups["attention"] == 4 * 32 * 32 + convs
    # a module reading the stream (the FFN's input norm's output) stays where the dataflow puts it
    assert roles["w1"] == "ffn.gate" and roles["attn_norm"] == "norm"


def test_a_loss_kept_with_its_graph_is_copied_detached_where_deepcopy_refuses_it():
    import copy

    block = zoo_numerics.SwitchAuxKept(32, 4)
    block(torch.randn(2, 5, 32)).sum()
    assert block.aux_loss.grad_fn is not None
    with pytest.raises(RuntimeError):
        copy.deepcopy(block)
    twin = module_copy(block)
    assert twin.aux_loss.grad_fn is None and torch.equal(twin.aux_loss, block.aux_loss.detach())
    assert twin.router.weight is not block.router.weight and torch.equal(twin.router.weight, block.router.weight)


def test_a_loss_kept_for_the_trainer_is_not_module_history_and_a_cache_with_its_graph_is():
    """train_state's history: SwitchAuxKept's aux_loss reaches the input through the router, by design (the trainer
    adds it to the step's loss); whether the walk found it depended on the graph (a warning in one sweep run of
    seq 10). Kept losses are left out; the same tensor under a cache's name is history."""
    from tblock_cli.checks.safety import held_with_history

    block = zoo_numerics.SwitchAuxKept(32, 4)
    x = torch.randn(2, 5, 32, requires_grad=True)
    block(x.clone()).sum().backward()
    assert block.aux_loss.grad_fn is not None and held_with_history(block, {id(x)}) == []
    block.k_cache = block.aux_loss * 1  # a tensor of its own, with the same graph behind it
    assert held_with_history(block, {id(x)}) == ["k_cache"]


def test_a_norm_is_held_to_its_class_name_only_where_it_does_not_normalise():
    """named_but_not_norms: a LayerNorm or RMSNorm by class whose output moves with its input's scale, or that
    normalises each channel over the tokens, is named; norms of other axis groupings, a large eps, modules that need a
    second input and modules named otherwise are not."""
    from tblock_cli.anatomy.norms import named_but_not_norms

    class LayerNormAll(nn.Module):  # over each sample's tokens and channels together: not per token, still a norm
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return nn.functional.layer_norm(x, x.shape[1:]) * self.weight

    class AdaLayerNorm(nn.Module):  # conditional: needs the conditioning too
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x, cond):
            return nn.functional.layer_norm(x, x.shape[-1:]) * (1 + cond) * self.weight

    class Gain(nn.Module):  # scales with its input and says nothing of norms
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * self.weight

    m = nn.ModuleDict({"bad": zoo_numerics.RMSNormNoSqrt(16), "wide_eps": nn.LayerNorm(16, eps=0.5),
                       "grid": LayerNormAll(16), "ada": AdaLayerNorm(16), "gain": Gain(16),
                       "tokens": zoo_numerics.RMSNormOverTokens(16)})
    got = named_but_not_norms(m, {}, 16, torch.device("cpu"))
    assert [g["name"] for g in got] == ["bad", "tokens"], got
    assert got[0]["ratio"] == pytest.approx(0.1, rel=1e-3) and got[0]["scaled"]  # 1 / the input's 10x
    # each channel normalised over the tokens: scale-invariant, but token 0 moves with the others (LayerNormAll, over
    # tokens and channels together, moves too but is no per-channel normalisation: a design)
    assert not got[1]["scaled"] and got[1]["tokens"] > 0.1


def test_a_selection_that_rounding_flips_is_not_judged_for_precision_and_positions_in_half_still_fail():
    """bfloat16 rounds a top-k's near-tied scores and picks other keys, anywhere along the sequence: `precision`
    skips it (precision.jumps). Rotary positions in bfloat16 leave the first positions exact and fail as before."""
    topk = run("zoo_attention.py:TopKAttention", ("precision",), causal=True)["precision"]
    assert topk.status is Status.SKIP and topk.kind == "precision.jumps", topk
    assert topk.facts["wrong_first"] >= 0.5 * topk.facts["wrong_last"] > 0 and topk.facts["exact"] < 0.01, topk.facts
    for name in ("Bf16Positions", "AutocastAngles"):
        c = run(f"zoo_training.py:{name}", ("precision",), causal=True)["precision"]
        assert c.status is Status.FAIL and c.kind == "precision.differs", c


def test_jumps_are_exact_positions_beside_wrong_ones_spread_along_the_sequence():
    """_jumps, on errors per position: flips scattered over the sequence beside exact positions are jumps; errors
    that start a third of the way in (positions past bfloat16's exact integers) are not, nor errors everywhere."""
    from tblock_cli.checks.precision import _jumps, _position_errors

    n = 90
    ref = torch.ones(1, n, 4)
    scattered = torch.full((n,), 1e-3)
    scattered[::3] = 0.5  # a third of the positions, from the first on
    late = torch.full((n,), 1e-3)
    late[n // 3 :] = 0.5
    everywhere = torch.full((n,), 0.5)
    for errors, jumps in ((scattered, True), (late, False), (everywhere, False)):
        got = ref + errors[None, :, None]  # each position's relative error (|got - ref| / |ref| over its channels)
        found = _jumps(_position_errors(got, ref, n))
        assert (found is not None) == jumps, (errors, found)
    assert _jumps(_position_errors(ref, ref, n)) is None  # nothing wrong: nothing to skip


def test_quiet_attention_is_read_as_a_softmax_with_a_sink():
    """softmax1's weights sum below 1: read as a softmax (log w the logits up to each row's constant), not as weights
    from no softmax, so relative finds its rotary-free scores flat and attention has nothing to say."""
    by = run("zoo_attention.py:QuietSoftmax", None, causal=True)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]
