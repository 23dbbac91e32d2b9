"""Positions in attention's values (relative.values_positioned): with every token identical, values projected from
identical rows are one row repeated; a rotary table applied to v breaks that, a sink in the softmax or a causal
convolution's zero padding at the start (Primer, tests/zoo_numerics.py) does not."""

import pytest
import zoo_values

import tblock_cli
from tblock_cli.checks import Status

from conftest import TESTS

BAD = {Status.WARN, Status.FAIL, Status.ERROR}


def run(name, **flags):
    return tblock_cli.check(f"{TESTS / 'zoo_values.py'}:{name}", d_model=32, n_heads=4, threads=1, causal=True, **flags)


def test_values_rotated_fail_relative_naming_the_call():
    c = run("ValuesRotated", only="relative").checks[0]
    assert c.status is Status.FAIL and c.kind == "relative.values_positioned", c.detail
    assert c.facts["values"] == ["v_proj"] and c.value > 1e-2, c.facts


@pytest.mark.parametrize("name", zoo_values.CORRECT)
def test_values_without_positions_raise_no_alarm(name):
    report = run(name)
    assert not [c for c in report.checks if c.status in BAD], [(c.name, c.detail) for c in report.checks if c.status in BAD]


def test_primers_convolved_values_pass_from_the_middle_on():
    c = tblock_cli.check(f"{TESTS / 'zoo_numerics.py'}:ConvolvedQKV", d_model=32, n_heads=4, threads=1, causal=True,
                         only="relative").checks[0]
    assert c.status is Status.PASS, c.detail


def test_values_laid_out_by_an_einsum_are_not_read_as_positions():
    """Eight heads and eight identical tokens: (B, T, H, E) values' axis -2 is the heads, which differ."""
    c = tblock_cli.check(f"{TESTS / 'zoo_values.py'}:EinsumValuesHeadsAfterTokens", d_model=64, n_heads=8, seq=8,
                         threads=1, causal=True, only="relative").checks[0]
    assert c.status is Status.PASS, c.detail
