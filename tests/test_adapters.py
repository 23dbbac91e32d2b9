"""Fine-tuning and reparametrisation designs (tests/zoo_adapters.py): LoRA's frozen bases and linear bottlenecks,
DoRA, torch's spectral and weight norms, Houlsby's adapters, IA3 and an int8 base pass the whole battery, as do two
recent papers' designs (tests/zoo_recent.py: Primer-EZ, differential attention); a frozen projection with no adapter
is still warned, a stop-gradient on the data still fails, and the card reads Primer's rotation."""

import pytest
import torch
import zoo_adapters
import zoo_recent

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.checks.optimizer import adapted

from conftest import TESTS

BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(name, only=None, zoo="zoo_adapters.py"):
    report = tblock_cli.check(f"{TESTS / zoo}:{name}", d_model=32, n_heads=4, threads=1,
                              causal=name not in zoo_recent.BIDIRECTIONAL, only=only)
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("zoo, name", [("zoo_adapters.py", n) for n in zoo_adapters.CORRECT]
                         + [("zoo_recent.py", n) for n in zoo_recent.CORRECT])
def test_each_design_raises_no_alarm_in_the_whole_battery(zoo, name):
    by = run(name, zoo=zoo)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


@pytest.mark.parametrize("name", sorted(zoo_adapters.WARNED))
def test_a_frozen_projection_without_an_adapter_is_still_warned(name):
    c = run(name, only="optimizer_step")["optimizer_step"]
    assert (c.status, c.kind) == (Status.WARN, zoo_adapters.WARNED[name]) and c.facts["frozen"] == ["o_proj.weight"], c


def test_an_adapter_is_a_low_rank_pair_of_the_frozen_weights_widths():
    base = torch.nn.Linear(16, 8).requires_grad_(False)
    parent = torch.nn.Module()
    parent.base = base
    parent.a, parent.b = torch.nn.Parameter(torch.zeros(2, 16)), torch.nn.Parameter(torch.zeros(8, 2))
    assert adapted(base, parent)
    parent.b = torch.nn.Parameter(torch.zeros(16, 2))  # B of another width: no adapter of this weight
    assert not adapted(base, parent)
    parent.b = torch.nn.Parameter(torch.zeros(8, 2), requires_grad=False)  # a frozen pair trains nothing
    assert not adapted(base, parent)
    parent.a, parent.b = torch.nn.Parameter(torch.zeros(8, 16)), torch.nn.Parameter(torch.zeros(8, 8))  # full rank
    assert not adapted(base, parent)


def test_spectral_norm_iterating_again_in_the_recompute_is_torchs_and_said():
    c = run("SpectralOut", only="checkpointing")["checkpointing"]
    assert c.kind == "checkpointing.same" and "o_proj.parametrizations.weight.original" in c.facts["power_iteration"], c


def test_a_stop_gradient_on_the_weights_passes_and_one_on_the_data_fails():
    dora = run("DoraV", only="derivative")["derivative"]
    assert dora.kind == "derivative.stop_gradient" and dora.facts["detached"] == 1 and "v_B" in dora.facts["tensors"], dora
    (name, kind), = zoo_adapters.PLANTED.items()
    c = run(name, only="derivative")["derivative"]
    assert c.kind == kind and c.status is Status.FAIL, c


def test_a_rotation_after_a_short_causal_convolution_is_read_past_its_padding():
    card = {e.key: e.value for e in tblock_cli.spec(f"{TESTS / 'zoo_recent.py'}:PrimerEZ", d_model=64, n_heads=4,
                                                    threads=1).card.entries}
    assert card["pos.kind"] == "rotary" and card["rope.theta"] == pytest.approx(10000, rel=0.02), card


def test_a_convolution_over_time_is_positions_and_a_head_scramble_is_not():
    c = run("Conformer", only="order", zoo="zoo_recent.py")["order"]
    assert c.kind == "order.positional" and c.facts["outputs"] > 0, c
    # heads merged without their transpose vary along the whole sequence of identical tokens: still warned
    scrambled = tblock_cli.check(f"{TESTS / 'zoo.py'}:HeadsNoTransposeNoMask", d_model=32, n_heads=4, threads=1,
                                 only="order").checks[0]
    assert scrambled.kind == "order.scrambled", scrambled
