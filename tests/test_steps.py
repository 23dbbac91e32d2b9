"""What a training step leaves on the block and what a batch shares (tests/zoo_steps.py): a kept tensor whose graph
each step extends is named; the same tensor overwritten by each call is not; torch's BatchNorm couples the samples of
a training batch by design, a batch mean beside it does not; norms whose class names say nothing are judged on the
unbiased variance's own RMS and, where the block names them norms, on a gain applied before the statistics."""

import math

import pytest
import torch
import zoo_steps

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.checks.graphs import carried_graphs, kept_graphs

from conftest import TESTS

BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(name, only=None, causal=True):
    return {c.name: c for c in tblock_cli.check(f"{TESTS / 'zoo_steps.py'}:{name}", d_model=32, n_heads=4, threads=1,
                                                causal=causal, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_steps.PLANTED))
def test_planted_bug_is_caught_by_its_check(name):
    check, kind = zoo_steps.PLANTED[name]
    c = run(name, only=check, causal="BatchNorm" not in name)[check]
    assert c.kind == kind and c.status in BAD, c


@pytest.mark.parametrize("name", zoo_steps.CORRECT)
def test_correct_twin_raises_no_alarm_in_the_whole_battery(name):
    by = run(name)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_a_graph_carried_from_step_to_step_is_named_and_one_overwritten_is_not():
    c = run("AuxLossSummedAcrossCalls", only="grad_accumulation")["grad_accumulation"]
    assert c.facts["tensors"] == ["aux_loss"], c.facts
    c = run("RunningStatWithGraph", only="grad_accumulation")["grad_accumulation"]
    assert c.facts["tensors"] == ["running_ms"], c.facts
    assert run("AuxLossPerCall", only="grad_accumulation")["grad_accumulation"].kind == "grad_accumulation.adds"


def test_carried_graphs_follows_the_graph_not_the_names():
    # independent of any block: a tensor built from the one kept before is carried, one built afresh is not
    m = torch.nn.Module()
    w = torch.ones(3, requires_grad=True)
    m.state = w * 2
    m.items = {"a": w * 3}
    before = kept_graphs(m)
    assert len(before) == 2  # state's graph and items['a']'s
    m.state = m.state + w  # extends the graph kept before
    m.items = {"a": w * 4}  # a new graph of its own
    assert carried_graphs(m, before) == ["state"]
    m.state = (m.state + w).detach()
    assert carried_graphs(m, before) == []


def test_torch_batch_norm_is_a_design_a_batch_mean_beside_it_is_a_leak():
    c = run("ConvModuleBatchNorm", only="batch", causal=False)["batch"]
    assert c.status is Status.PASS and c.kind == "batch.batch_norm" and c.facts["norms"] == ["batch_norm"], c
    assert c.facts["gradient"] > 0  # the train-mode leak it found is BatchNorm's, and said so
    c = run("BatchNormBesideBatchMean", only="batch", causal=False)["batch"]
    assert c.status is Status.FAIL and c.kind == "batch.leak_train" and c.facts["stream_norms"] == [], c
    # a BatchNorm in a LayerNorm's place, reading the residual stream itself, is no design
    c = tblock_cli.check(f"{TESTS / 'zoo_mixing.py'}:BatchNormLeak", d_model=32, n_heads=4, threads=1,
                         only="batch").checks[0]
    assert c.kind == "batch.leak_train" and c.facts["stream_norms"] == ["bn"], c


def test_unbiased_variance_is_read_off_its_rms_whatever_the_class_is_called():
    c = run("UnbiasedNormBlock", only="norms")["norms"]
    width = 32
    assert c.value == pytest.approx(math.sqrt((width - 1) / width), abs=1e-5), c  # sqrt(31 / 32), derived
    assert {n["name"] for n in c.facts["off_unit"]} == {"attn_norm", "ffn_norm"}
    assert run("BiasedNormBlock", only="norms")["norms"].kind == "norms.ok"


def test_a_gain_inside_the_statistics_is_warned_where_the_block_names_the_module_a_norm():
    c = run("GainFirstNormBlock", only="norms")["norms"]
    assert c.status is Status.WARN and {n["name"] for n in c.facts["not_affine"]} == {"attn_norm", "ffn_norm"}, c


def test_names_are_not_judged_on_roles_read_off_a_product_no_softmax_follows():
    by = run("LinearAttention", only="names,attention")
    assert by["names"].status is Status.PASS, by["names"]  # before: q_proj "made attn.v" by the k.v product
    assert by["attention"].kind == "attention.no_softmax", by["attention"]  # the design, said as a warning


def test_one_projection_under_two_names_is_named_where_the_forward_calls_it_twice():
    c = run("QueryIsKey", only="optimizer_step")["optimizer_step"]
    assert c.kind == "optimizer_step.repeated" and c.facts["repeats"] == [["q_proj", "k_proj"]], c
    c = run("GateIsUp", only="optimizer_step")["optimizer_step"]
    assert c.facts["repeats"] == [["w1", "w3"]], c
    assert run("OldNameKept", only="optimizer_step")["optimizer_step"].kind == "optimizer_step.ok"
