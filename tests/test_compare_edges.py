"""compare at its edges: a block's own dropout, tolerances that judge nothing, flags named as the user gave them,
the side that differs named, and None as the built-in block (as documented)."""

import pytest
import torch.nn as nn
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError, LoadError

runner = CliRunner()
S = {"d_model": 64, "n_heads": 4, "threads": 1, "seq": 8}


def encoder(dropout: float, norm_first: bool = False) -> nn.Module:
    return nn.TransformerEncoderLayer(64, 4, 128, dropout=dropout, batch_first=True, norm_first=norm_first)


def test_a_block_with_its_own_dropout_equals_itself():
    """Before, `compare m m` drew other dropout masks on each side: "DIFFERS" in the gradients (0.18 relative)."""
    m = encoder(0.1)
    report = tblock_cli.compare(m, m, **S)
    assert report.ok and all(c.equal for c in report.comparisons), [(c.name, c.rel) for c in report.comparisons]
    assert {c.name for c in report.comparisons} >= {"outputs", "input_grad", "param_grads"}
    assert [mod.p for mod in m.modules() if isinstance(mod, nn.Dropout)] == [0.1, 0.1, 0.1]  # the caller's, untouched


@pytest.mark.xdist_group("hf")  # dynamo (~1 s to import) on the worker that imports it for tests/test_compare.py
def test_a_block_with_its_own_dropout_equals_its_compiled_self():
    report = tblock_cli.compare(encoder(0.1), compile=True, backend="eager", **S)
    assert report.ok, [(c.name, c.rel) for c in report.comparisons]


@pytest.mark.parametrize("flag, value", [("rtol", float("inf")), ("atol", float("nan")), ("atol", float("-inf"))])
def test_a_tolerance_that_judges_nothing_is_refused(flag, value):
    with pytest.raises(ConfigError, match=f"--{flag} must be a finite number"):
        tblock_cli.compare(None, "builtin", **{flag: value}, **S)


@pytest.mark.parametrize("args, words", [(["--rtol", "inf"], "--rtol must be a finite"), (["--atol", "nan"], "--atol must be a finite"),
                                         (["--dtype-b", ""], "--dtype-b must be one of"), (["--kwargs-a", "{"], "--kwargs-a is not valid JSON"),
                                         (["--kwargs-b", "[1]"], "--kwargs-b must be a JSON object")])
def test_cli_errors_name_the_flag_given(args, words):
    res = runner.invoke(app, ["compare", "builtin", "builtin", "--d-model", "64", "--n-heads", "4", *args])
    assert res.exit_code == 2 and words in res.stderr, res.output


def test_mismatched_widths_name_the_side():
    wide = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
    with pytest.raises(ConfigError, match="d_model: A 64, B 128"):
        tblock_cli.compare(encoder(0.0), wide, threads=1, seq=8)
    with pytest.raises(LoadError, match="^side B: "):  # given one width for both, B's forward cannot take it
        tblock_cli.compare(encoder(0.0), wide, **S)


def test_a_missing_b_is_named_as_missing_and_none_for_a_is_the_builtin_block():
    """The docstring said None was the built-in block on either side, while compare(m, None) refused: None stands
    for the built-in block as A only; a missing B is refused naming it (never silently the built-in block)."""
    doc = tblock_cli.compare.__doc__
    assert "B is None only with compile=True" in doc
    m = encoder(0.0, norm_first=True)
    with pytest.raises(ConfigError, match="B is missing"):
        tblock_cli.compare(m, None, **S)
    report = tblock_cli.compare(None, m, d_ff=128, **S)
    assert report.a == "builtin" and report.ok, [(c.name, c.rel) for c in report.comparisons]
    res = runner.invoke(app, ["compare", "builtin", "--d-model", "64", "--n-heads", "4"])
    assert res.exit_code == 2 and "compare needs two blocks" in res.stderr
