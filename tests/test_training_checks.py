"""The training-time checks (issue 34): each planted bug of tests/zoo_training.py caught by the check meant for it,
named where the check names things; the correct twins (kinks, top-k routing, a correct custom backward, a correct
checkpointing switch, a real tie) left clean; the probes' own machinery against independent truths."""

import json

import pytest
import torch
import torch.nn as nn
import zoo_autocast
import zoo_hooks
import zoo_training

import tblock_cli
from tblock_cli.checks import Status, precision, run_checks
from tblock_cli.checks.checkpointing import recomputed
from tblock_cli.checks.lifecycle import hidden_params, own_init, plain_tensors, roots
from tblock_cli.checks.optimizer import adamw_first_step, broken_ties
from tblock_cli.checks.precision import _token_error
from tblock_cli.checks.training import has_dropout, seeded
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}
NEW = ("derivative", "checkpointing", "meta_init", "state_dict", "precision", "optimizer_step")


def run(name, only=NEW, dtype=torch.float32, spec_file="zoo_training.py", **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    subject = make_subject(cfg, CPU, dtype, f"{TESTS / spec_file}:{name}" if name else None)
    return {c.name: c for c in run_checks(subject, cfg, CPU, dtype, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_training.PLANTED))
def test_planted_training_bug_is_caught_by_its_check(name):
    check = zoo_training.PLANTED[name]
    by = run(name, only=(check,))
    assert by[check].status in BAD, by[check]


@pytest.mark.parametrize("name", zoo_training.CORRECT)
def test_correct_twin_raises_no_alarm_in_the_whole_battery(name):
    by = run(name, only=None)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_a_gradient_hook_is_carried_to_the_copies_the_checks_difference():
    # the copy derivative differences keeps the hook: doubling the gate's gradient is named, exactly 2x off
    c = run("HookDoublesGradient", only=("derivative",), spec_file="zoo_hooks.py")["derivative"]
    assert c.status is Status.FAIL and c.facts["tensor"] == "w1.weight", c
    assert dict(c.facts["tensors"])["w1.weight"] == pytest.approx(0.5, rel=1e-3)  # |2g - g| / |2g|
    by = run(zoo_hooks.CORRECT[0], only=None, spec_file="zoo_hooks.py")  # a hook the derivative agrees with
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_code_written_for_float32_is_a_skip_of_the_float64_checks_not_an_error():
    # its float64 copy's backward meets float32 in a matmul and raises: derivative cannot difference it, and the
    # float32 backward it was written for is grad_input's and grad_params' (both pass)
    by = run("Float32Backward", only=None, spec_file="zoo_float_only.py")
    assert by["derivative"].kind == "derivative.no_float64" and "dtype" in by["derivative"].facts["error"], by["derivative"]
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]
    # its float64 reference forward raises likewise: dtype cannot measure it
    by = run("Float32Probabilities", only=None, spec_file="zoo_float_only.py")
    assert by["dtype"].kind == "dtype.no_float64" and "Double" in by["dtype"].facts["error"], by["dtype"]
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_a_block_that_raises_under_autocast_on_mixing_dtypes_fails_and_its_cast_twin_passes():
    c = run("IndexedExperts", only=("precision",), spec_file="zoo_autocast.py")["precision"]
    assert c.status is Status.FAIL and c.kind == "precision.dtype_clash" and "dtypes match" in c.facts["error"], c
    assert c.facts["how"] == "torch.autocast (bfloat16)"
    assert c.facts["op"] == "__setitem__" and (c.facts["into"], c.facts["values"]) == ("float32", "bfloat16")
    cache = run("CacheInItsDtype", only=("precision",), spec_file="zoo_autocast.py")["precision"]
    assert cache.status is Status.SKIP and cache.kind == "precision.unsupported", cache  # a cache is the block's state
    by = run(zoo_autocast.CORRECT[0], only=None, spec_file="zoo_autocast.py")
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_autocast_that_changes_the_streams_dtype_or_breaks_the_backward_fails_and_the_twins_pass():
    c = run("ResidualTypeAsBranch", only=("precision",), spec_file="zoo_autocast.py")["precision"]
    assert c.kind == "precision.autocast_dtype" and (c.facts["got"], c.facts["want"]) == ("bfloat16", "float32"), c
    c = run("CustomLinearNoCast", only=("precision",), spec_file="zoo_autocast.py")["precision"]
    assert c.kind == "precision.dtype_clash" and "backward" in c.facts["how"] and "dtype" in c.facts["error"], c
    for twin in ("ResidualCastToStream", "CustomLinearCast"):
        c = run(twin, only=("precision",), spec_file="zoo_autocast.py")["precision"]
        assert c.kind == "precision.close", (twin, c)


@pytest.mark.parametrize("name", ["TrainBlock", "MoEBlock"])
def test_correct_twin_is_clean_in_bfloat16_runs(name):
    by = run(name, dtype=torch.bfloat16)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_derivative_names_the_tensors_a_detach_starves():
    # attn_norm's output is detached: its weight's whole derivative is missing (relative error 1), the input's part
    # through attention too; every parameter after the cut (q, k, v, o, the FFN) gets its gradient right
    c = run("DetachedBranch", only=("derivative",))["derivative"]
    blamed = dict(c.facts["tensors"])
    assert c.kind == "derivative.wrong" and set(blamed) == {"attn_norm.weight", "input"}, c.facts
    assert blamed["attn_norm.weight"] == pytest.approx(1.0, abs=1e-3)


def test_derivative_of_a_flipped_backward_is_off_by_two():
    # autograd says -d where the derivative is d: |(-d) - d| / |d| = 2 along any direction
    c = run("NegatedGradient", only=("derivative",))["derivative"]
    assert c.facts["error"] == pytest.approx(2.0, rel=1e-2), c.facts  # rel: the rotary angles are float32 on purpose


def test_derivative_reports_its_cost_and_rng_use():
    c = run("TrainBlock", only=("derivative",))["derivative"]
    assert c.kind == "derivative.matches" and c.facts["dropout"] is True
    # one forward + backward of the float64 copy, then 2 forwards per step, 3 steps, per direction
    assert (c.passes.forward, c.passes.backward) == (1 + 2 * 3 * c.facts["directions"], 1)
    assert len(c.facts["errors"]) == c.facts["directions"] and all(set(e) == {"distance", "spread"} for e in c.facts["errors"])


def test_checkpointing_turns_on_the_blocks_own_switch():
    c = run("CheckpointedBlock", only=("checkpointing",))["checkpointing"]
    assert c.status is Status.PASS and c.facts["switches"] == ["use_checkpoint = True"], c.facts
    bad = run("OwnCheckpointNoRng", only=("checkpointing",))["checkpointing"]
    assert bad.kind == "checkpointing.differs" and bad.facts["how"] == "use_checkpoint = True", bad.facts


def test_checkpointing_names_parameters_a_reentrant_checkpoint_drops():
    c = run("ReentrantInside", only=("checkpointing",))["checkpointing"]
    assert c.kind == "checkpointing.input_without_grad"
    assert set(c.facts["params"]) == {n for n, _ in zoo_training.TrainBlock(32, 4).named_parameters()}


def test_meta_init_names_the_buffer_nothing_recomputes():
    c = run("RotaryInitOnly", only=("meta_init",))["meta_init"]
    assert c.kind == "meta_init.buffers" and c.facts["buffers"] == ["rotary.inv_freq"], c.facts
    twin = run("TrainBlock", only=("meta_init",))["meta_init"]
    assert twin.kind == "meta_init.same" and twin.facts["checked"] == 1, twin.facts


def test_meta_init_skips_a_block_whose_own_init_leaves_parameters_unset():
    c = run("IdiomRoPE", only=("meta_init",))["meta_init"]
    assert c.kind == "meta_init.incomplete_init" and c.facts["params"] == ["attn_norm.weight", "ffn_norm.weight"], c.facts
    assert c.facts["buffers"] == ["rotary.inv_freq"]  # named, not judged


def test_meta_init_skips_a_module_handed_over_as_an_instance():
    r = tblock_cli.check(zoo_training.TrainBlock(32, 4), d_model=32, n_heads=4, only=("meta_init", "state_dict"))
    by = {c.name: c for c in r.checks}
    assert by["meta_init"].kind == "meta_init.no_factory"
    assert by["state_dict"].kind == "state_dict.round_trip" and by["state_dict"].facts["fresh"] == "copy"


def test_state_dict_names_hidden_parameters_and_plain_tensors():
    c = run("ListParams", only=("state_dict",))["state_dict"]
    assert c.kind == "state_dict.hidden_params" and c.facts["hidden_params"] == ["ListParams.gains[0]", "ListParams.gains[1]"]
    c = run("PlainTensorAttr", only=("state_dict",))["state_dict"]
    assert c.kind == "state_dict.outputs" and c.facts["plain_tensors"] == ["PlainTensorAttr.mix"], c.facts
    c = run("UnsavedBuffer", only=("state_dict",))["state_dict"]
    assert c.kind == "state_dict.outputs" and not c.facts["missing"] and not c.facts["unexpected"], c.facts


def test_precision_names_the_rotary_in_both_ways_positions_get_lost():
    c = run("Bf16Positions", only=("precision",))["precision"]
    assert c.facts["how"] == "to_bfloat16" and c.facts["component"] == "rotary", c.facts
    c = run("AutocastAngles", only=("precision",))["precision"]
    assert c.facts["how"] == "autocast" and c.facts["component"] == "rotary", c.facts


def test_optimizer_step_names_a_broken_tie_and_a_frozen_norm_but_not_a_real_tie():
    c = run("TieBrokenByCopy", only=("optimizer_step",))["optimizer_step"]
    assert c.kind == "optimizer_step.tie_broken" and c.facts["ties"] == [["q_proj.weight", "k_proj.weight"]]
    c = run("FrozenNorm", only=("optimizer_step",))["optimizer_step"]
    assert c.status is Status.WARN and c.facts["frozen"] == ["ffn_norm.weight"]
    c = run("TiedBlock", only=("optimizer_step",))["optimizer_step"]
    assert c.kind == "optimizer_step.ok" and not c.facts["ties"] and not c.facts["unchanged"], c.facts


def test_every_training_check_reports_its_cost_in_json():
    r = tblock_cli.check(f"{TESTS / 'zoo_training.py'}:TrainBlock", d_model=32, n_heads=4, only=NEW)
    for c in json.loads(json.dumps(r.to_dict()))["checks"]:
        assert c["passes"]["equivalents"] > 0 and c["seconds"] >= 0, c


# ----------------------------------------------------------------------------- the probes' machinery


def test_seeded_repeats_dropout_masks_and_restores_the_callers_rng():
    before = torch.get_rng_state()
    with seeded(CPU):
        a = nn.functional.dropout(torch.ones(1000), 0.5)
    with seeded(CPU):
        b = nn.functional.dropout(torch.ones(1000), 0.5)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), before)


def test_broken_ties_ignores_constants_and_shared_objects():
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    m = nn.ModuleDict({"a": a, "b": b, "n1": nn.LayerNorm(8), "n2": nn.LayerNorm(8)})
    assert broken_ties(m) == []  # two LayerNorms both at ones and zeros: not evidence
    b.weight.data.copy_(a.weight.data)
    assert broken_ties(m) == [["a.weight", "b.weight"]]
    b.weight = a.weight  # a real tie: one Parameter
    assert broken_ties(m) == []


def test_plain_tensors_and_hidden_params_are_found_where_they_hide():
    m = nn.Module()
    m.child = nn.Linear(2, 2)
    m.child.table = torch.zeros(3)
    m.child.cache = [torch.ones(1)]
    m.gains = [nn.Parameter(torch.ones(2))]
    m.kept = nn.Parameter(torch.ones(2))
    m.listed = [m.kept]  # registered elsewhere: not hidden
    assert set(plain_tensors(m)) == {"Linear.table", "Linear.cache[0]"}
    assert hidden_params(m) == ["Module.gains[0]"]


def test_roots_include_a_model_kept_as_a_plain_attribute_once():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    outer = nn.Module()
    outer.layer = inner[0]
    outer.__dict__["_model"] = inner  # outside the registry, as the HF driver keeps its model
    assert roots(outer) == [outer, inner]


def test_own_init_runs_reset_parameters_including_multihead_attentions_private_one():
    m = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))
    own_init(m)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_token_error_is_a_quantile_over_positions():
    ref = torch.ones(1, 8, 4)
    got = ref.clone()
    got[0, :1] += 1.0  # one of eight positions off by 100 %: the 75th percentile is among the seven untouched
    assert _token_error(got, ref, 8) == pytest.approx(0.0)
    got = ref.clone()
    got[0, :4] += 0.5  # half the positions off by 0.5 (relative): the 75th percentile lands among them
    assert _token_error(got, ref, 8) == pytest.approx(0.5)
    assert _token_error(got, ref, 5) is None  # no axis of the probe's length
    # an expert's (routed tokens, hidden) output whose hidden width equals the probe's length: features, not positions
    assert _token_error(got[0, :5], ref[0, :5], 4) is None and _token_error(got[0], ref[0], 8) == pytest.approx(0.5)


def test_has_dropout_sees_modules_and_rates_attention_reads():
    assert has_dropout(nn.Sequential(nn.Dropout(0.1)))
    assert not has_dropout(nn.Sequential(nn.Dropout(0.0)))
    m = nn.Linear(2, 2)
    m.attention_dropout = 0.1
    assert has_dropout(m)


def test_recomputed_runs_the_forward_again_and_gives_torchs_checkpoint_gradients():
    from torch.utils.checkpoint import checkpoint

    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True).train()
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 5, 16)

    def grads(run):
        layer.zero_grad()
        xr = x.clone().requires_grad_(True)
        with seeded(CPU):
            run(xr).pow(2).sum().backward()
        return [xr.grad] + [p.grad.clone() for p in layer.parameters()]

    plain = grads(layer)
    ours = grads(lambda t: recomputed(layer, t, CPU))
    assert len(calls) == 3  # plain, our forward, our recompute in the backward
    torchs = grads(lambda t: checkpoint(layer, t, use_reentrant=False))
    for a, b, c in zip(plain, ours, torchs):
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(b, c, atol=1e-6)


def test_adamw_first_step_is_torchs():
    torch.manual_seed(0)
    a = nn.Linear(6, 3)
    b = nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 6)
    for m in (a, b):
        m(x).pow(2).sum().backward()
    torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.0).step()
    adamw_first_step(list(b.parameters()), 1e-3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-7, rtol=0)


def test_state_dict_leaves_a_zero_dim_scale_and_a_per_call_mask_alone():
    class Scaled(nn.Module):
        def __init__(self, d_model=32, n_heads=4):
            super().__init__()
            self.lin = nn.Linear(d_model, d_model)
            self.scale = torch.tensor(0.5)  # 0-dim: mixes with any device and dtype

        def forward(self, x):
            self.mask = torch.ones_like(x)  # assigned and read within the call: scratch, not state
            return x + self.lin(x) * self.scale * self.mask

    r = tblock_cli.check(Scaled, d_model=32, n_heads=4, only=("state_dict",))
    assert r.checks[0].kind == "state_dict.round_trip" and not r.checks[0].facts["plain_tensors"], r.checks[0]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bfloat16 tensors in units in the last place (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def test_float_accumulated_products_are_bfloat16_products_rounded_once():
    # each op: exactly the float32 product of the same bfloat16 values rounded once (bias added before the rounding),
    # and within one unit in the last place of PyTorch's own bfloat16 kernel (summation order only)
    g = torch.Generator().manual_seed(0)
    h = lambda *s: (torch.randn(*s, generator=g) + 3).bfloat16()  # noqa: E731 - positive: ulps compare as ints
    a, b, bias = h(24, 40), h(40, 16), h(16)
    a3, b3, c3 = h(3, 24, 40), h(3, 40, 16), h(3, 24, 16)
    cases = [(torch.mm, (a, b)), (torch.bmm, (a3, b3)), (torch.addmm, (bias, a, b)), (torch.baddbmm, (c3, a3, b3)),
             (nn.functional.linear, (a, b.t(), bias))]
    for op, args in cases:
        with precision._emulated(True):
            got = op(*args)
        wide = op(*[t.float() for t in args]).bfloat16()
        assert got.dtype == torch.bfloat16 and torch.equal(got, wide), op
        assert _ulps(got, op(*args)) <= 1, op


def test_emulation_turns_the_mha_fast_path_off_and_back_even_on_error():
    before = torch.backends.mha.get_fastpath_enabled()
    with pytest.raises(ValueError), precision._emulated(True):
        assert not torch.backends.mha.get_fastpath_enabled()
        raise ValueError
    assert torch.backends.mha.get_fastpath_enabled() == before


def test_precision_measures_the_same_with_emulated_and_native_products(monkeypatch):
    # the emulation changes how fast, not what: both errors of the correct block and the planted bugs' agree
    for name in ("TrainBlock", "Bf16Positions", "AutocastAngles"):
        by = {}
        for emulate in (True, False):
            monkeypatch.setattr(precision, "emulates_half_products", lambda _d, e=emulate: e)
            by[emulate] = run(name, only=("precision",))["precision"]
        assert by[True].facts["products"] == "float32-accumulated" and by[False].facts["products"] == "native"
        assert by[True].status == by[False].status, name
        for how, err in by[False].facts["errors"].items():
            assert by[True].facts["errors"][how] == pytest.approx(err, rel=0.5), (name, how)


def test_precision_runs_natively_when_the_emulation_cannot(monkeypatch):
    def refuse(ops, func, args, kwargs):
        raise RuntimeError("not under a dispatch mode")
    monkeypatch.setattr(precision, "emulates_half_products", lambda _d: True)
    monkeypatch.setattr(precision, "_float_accumulated", refuse)
    c = run("TrainBlock", only=("precision",))["precision"]
    assert c.status is Status.PASS and c.facts["products"] == "native", c


@pytest.mark.xdist_group("hf")  # dynamo's import, on the worker that has it
def test_a_compiled_block_is_measured_the_same_under_the_emulation(monkeypatch):
    # torch.compile imports dynamo first: the mode is then the one dynamo leaves alone, and the values stand
    block = torch.compile(zoo_training.TrainBlock(32, 4), backend="eager")
    by = {}
    for emulate in (True, False):
        monkeypatch.setattr(precision, "emulates_half_products", lambda _d, e=emulate: e)
        by[emulate] = tblock_cli.check(block, d_model=32, n_heads=4, only="precision").checks[0]
    assert by[True].facts["products"] == "float32-accumulated" and by[True].status is Status.PASS, by[True]
    for how, err in by[False].facts["errors"].items():
        assert by[True].facts["errors"][how] == pytest.approx(err, rel=0.5), how


def test_an_init_that_assigns_new_parameters_is_warned():
    """After to_empty, reset_parameters must fill the Parameters it was given: new ones are made on the default device
    and leave ties, optimizers and shardings holding the old. Twin: TrainBlock, whose RMSNorm fills in place."""
    c = run("NormReplacedAtInit", only=("meta_init",), spec_file="zoo_construction.py")["meta_init"]
    assert c.status is Status.WARN and c.kind == "meta_init.replaced", c
    assert c.facts["replaced"] == ["attn_norm.weight", "ffn_norm.weight"] and c.facts["diff"] == 0.0
    assert run("TrainBlock", only=("meta_init",))["meta_init"].status is Status.PASS


def test_a_count_the_recompute_runs_again_is_caught_and_the_buffers_are_put_back():
    """Outputs and gradients agree under checkpointing; the tokens counted per expert do not (twice the plain step's).
    The twin counts outside a backward only. Each compared step starts from the buffers as they were."""
    c = run("ExpertCountsRecounted", only=("checkpointing",), spec_file="zoo_construction.py")["checkpointing"]
    assert c.kind == "checkpointing.state" and c.facts["buffers"] == ["tokens_per_expert"], c
    ok = run("ExpertCountsOnce", only=("checkpointing",), spec_file="zoo_construction.py")["checkpointing"]
    assert ok.kind == "checkpointing.same", ok

