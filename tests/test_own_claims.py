"""The `spec` check without a declaration: what a block says of itself (constructor arguments, configs, attributes)
held against its card. Planted contradictions of tests/zoo_claims.py caught and named, the twins that honour what
they say passing, and the reading rules: arguments before attributes, a key given two values claims nothing, only
names whose meaning is not in doubt."""

from dataclasses import dataclass

import pytest
import torch.nn as nn
import zoo_claims

import tblock_cli
from tblock_cli.card.own import FRACTION, own_claims, with_fraction
from tblock_cli.checks import Status

from conftest import TESTS


def spec_check(name, **flags):
    spec = f"{TESTS / 'zoo_claims.py'}:{name}"
    return tblock_cli.check(spec, d_model=32, n_heads=4, causal=True, threads=1, only="spec", **flags).checks[0]


@pytest.mark.parametrize("name", sorted(zoo_claims.PLANTED))
def test_a_block_that_contradicts_itself_fails_naming_the_entry(name):
    c = spec_check(name)
    assert c.status is Status.FAIL and c.kind == "spec.not_like", c
    assert [d["key"] for d in c.facts["differs"]] == [zoo_claims.PLANTED[name]]
    assert c.facts["own"] and "the block's own" in c.facts["differs"][0]["source"]


@pytest.mark.parametrize("name", zoo_claims.CORRECT)
def test_a_block_that_honours_what_it_says_passes(name):
    c = spec_check(name)
    assert c.status is Status.PASS and c.kind == "spec.matches" and c.facts["matched"] >= 1, c


def test_the_rotary_base_asked_for_is_the_one_judged():
    c = spec_check("RotaryBaseIgnored")
    (d,) = c.facts["differs"]
    assert d["claimed"] == 500000.0 and d["measured"] == pytest.approx(10000.0, rel=1e-3)
    assert "`rope_theta`" in d["source"]


def test_a_declaration_replaces_what_the_block_says():
    c = spec_check("RotaryBaseIgnored", expect=["rope.theta=10000"])
    assert c.status is Status.PASS and not c.facts["own"]


def test_reading_rules():
    class RotaryEmbedding(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

    class Mixer(nn.Module):  # not an attention module: its `scale` is not a score scale
        def __init__(self):
            super().__init__()
            self.scale = 0.5

    @dataclass
    class Config:
        rope_theta: float = 1e6
        hidden_act: str = "gelu_pytorch_tanh"
        softcap: float | None = None  # off: nothing to hold against the card

    def claims(modules, arguments=None):
        return {c.key: c.value for c in own_claims(modules, arguments)}

    # an argument speaks before a module's attribute; configs are read field by field
    assert claims([RotaryEmbedding(1e4)], {"config": Config()}) == {"rope.theta": 1e6, "ffn.act": "gelu_tanh"}
    assert claims([RotaryEmbedding(1e4)]) == {"rope.theta": 1e4}
    # two values for one key in the same tier: nothing claimed
    assert claims([RotaryEmbedding(1e4), RotaryEmbedding(5e5)]) == {}
    # `base` only on a rotary module, `scale` only on an attention module
    assert claims([Mixer()]) == {}
    m = nn.Module()
    m.base = 10000.0
    assert claims([m]) == {}


def test_a_rotating_fraction_becomes_rope_dims_of_the_measured_head():
    (fraction,) = own_claims([], {"partial_rotary_factor": 0.25})
    assert fraction.key == FRACTION and fraction.value == 0.25
    assert [(c.key, c.value) for c in with_fraction((fraction,), 64)] == [("rope.dims", 16.0)]
    assert with_fraction((fraction,), None) == ()  # the head's width unread: nothing to hold it against
