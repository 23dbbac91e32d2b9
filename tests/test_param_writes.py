"""A forward should leave the block's trainable parameters as it found them (input_unchanged.parameters, a warning):
writes through no_grad and through .data are both seen; buffers, frozen parameters (a router bias a balancing rule
updates) and an Embedding's own max_norm renormalisation are not judged."""

import pytest
import zoo_writes

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.checks.forward import fingerprint

from conftest import TESTS

BAD = {Status.WARN, Status.FAIL, Status.ERROR}


def run(name, **flags):
    return tblock_cli.check(f"{TESTS / 'zoo_writes.py'}:{name}", d_model=32, n_heads=4, threads=1, **flags)


def test_parameters_frozen_by_a_mode_switch_fail_train_state():
    c = run("EvalFreezes", only="train_state").checks[0]
    assert c.status is Status.FAIL and c.kind == "train_state.frozen" and c.value == 9 and "q_proj.weight" in c.facts["frozen"], c


@pytest.mark.parametrize("name", sorted(n for n, check in zoo_writes.PLANTED.items() if check == "input_unchanged"))
def test_a_forward_that_writes_its_parameters_is_warned_naming_them(name):
    c = run(name, only="input_unchanged").checks[0]
    assert c.status is Status.WARN and c.kind == "input_unchanged.parameters", c
    assert c.facts["parameters"] == (["w2.weight"] if name == "NormalisedInForward" else ["w1.weight"])


@pytest.mark.parametrize("name", zoo_writes.CORRECT)
def test_a_buffer_written_by_every_forward_raises_no_alarm(name):
    report = run(name, causal=True)
    assert not [c for c in report.checks if c.status in BAD], [(c.name, c.detail) for c in report.checks if c.status in BAD]


def test_an_embeddings_own_max_norm_renormalisation_is_not_a_write():
    assert run("MaxNormPositions", only="input_unchanged").checks[0].status is Status.PASS


def test_the_fingerprint_moves_with_any_write_and_not_without():
    import torch.nn as nn

    lin = nn.Linear(8, 8)
    before = fingerprint(lin)
    assert fingerprint(lin) == before
    lin.weight.data[3, 5] += 1e-4  # one element, by a ten-thousandth
    assert fingerprint(lin)["weight"] != before["weight"] and fingerprint(lin)["bias"] == before["bias"]
    emb = nn.Embedding(4, 8, max_norm=1.0)
    assert fingerprint(emb) == {}
    lin.bias.requires_grad_(False)  # frozen: a buffer in all but name
    assert list(fingerprint(lin)) == ["weight"]
