"""2D positions over a patch grid (tests/zoo_grids.py): BEiT's relative bias table and EVA-02's 2D rotary, a class
token then a 3 x 3 grid, 10 tokens and no other length. `relative` reads the grid instead of failing i - j, `shape`
and `position_bias` leave the fixed length alone, and a 2D rotary whose q and k turn by crossed axes still fails."""

import pytest
import torch
import zoo_grids

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.checks.offsets import grid_fit, toeplitz_error

from conftest import TESTS

BAD = {Status.WARN, Status.FAIL, Status.ERROR}


def battery(name, **flags):
    r = tblock_cli.check(f"{TESTS / 'zoo_grids.py'}:{name}", d_model=32, n_heads=4, seq=zoo_grids.TOKENS, threads=1,
                         **flags)
    return {c.name: c for c in r.checks}


@pytest.mark.parametrize("name", zoo_grids.CORRECT)
def test_a_2d_position_scheme_is_read_on_its_grid_and_raises_no_alarm(name):
    by = battery(name)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]
    assert by["relative"].kind == "relative.grid" and by["relative"].facts["grids"] == [{"prefix": 1, "width": 3}]
    assert by["shape"].kind == "shape.fixed_length"


def test_the_bias_table_is_not_read_over_a_length_the_block_does_not_take():
    assert battery("GridBiasBlock", only="position_bias")["position_bias"].kind == "position_bias.length"


@pytest.mark.parametrize("name, check", sorted(zoo_grids.PLANTED.items()))
def test_a_2d_rotary_with_crossed_axes_fails(name, check):
    c = battery(name, only=check)[check]
    assert c.status is Status.FAIL and c.kind == "relative.not_toeplitz", c


def test_grid_fit_reads_a_function_of_the_2d_offset_and_nothing_else():
    n, w = 9, 3
    i = torch.arange(n)
    f = torch.randn(2 * n, 2 * w)
    z = torch.zeros(1 + n, 1 + n)
    z[1:, 1:] = f[i[:, None] // w - i[None, :] // w + n, i[:, None] % w - i[None, :] % w + w]
    z[0, :], z[:, 0] = torch.randn(1 + n), torch.randn(1 + n)  # the class token's own entries: anything
    assert toeplitz_error(z) > 1e-2 and grid_fit(z, 1e-6) == {"prefix": 1, "width": 3}
    z[4, 7] += 0.5  # one entry off its offset's value
    assert grid_fit(z, 1e-6) is None
    assert grid_fit(torch.randn(10, 10), 1e-4) is None
