"""The Python API: the same battery on a module object, reports with .ok and .to_dict(), assert_ok."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError

import zoo


def tel(**kw):
    return nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True, **kw)


def test_check_on_a_module_instance():
    report = tblock_cli.check(tel(), d_model=64)
    assert report.ok, report.failing
    assert report.to_dict()["subject"] == "TransformerEncoderLayer"
    assert report.to_dict()["environment"]["threads"] == torch.get_num_threads()


def test_a_block_without_residual_is_not_ok_and_assert_ok_says_why():
    report = tblock_cli.check(zoo.NoResidual(64, 4))
    assert not report.ok
    with pytest.raises(AssertionError, match="residual: fail"):
        tblock_cli.assert_ok(report)
    tblock_cli.assert_ok(tblock_cli.check(tel(), d_model=64))  # silent when ok


def test_d_model_is_inferred_from_the_module_or_a_clear_error():
    assert tblock_cli.check(zoo.Good(48, 4)).run.config["d_model"] == 48

    class Opaque(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="d_model"):
        tblock_cli.check(Opaque())


def test_params_total_is_the_modules_parameter_count():
    layer = tel()
    data = tblock_cli.params(layer, d_model=64).to_dict()
    assert data["total"] == sum(p.numel() for p in layer.parameters())
    assert data["command"] == "params" and data["schema_version"] == 1


def test_factory_and_spec_and_builtin():
    assert tblock_cli.check(lambda: zoo.Good(32, 4), d_model=32).ok
    assert tblock_cli.check("torch.nn:TransformerEncoderLayer", d_model=32, n_heads=4, kwargs={"dropout": 0.0}).ok
    assert tblock_cli.check(d_model=32, n_heads=4).run.subject == "built-in pre-LN block"


def test_to_dict_is_exactly_what_json_prints():
    res = CliRunner().invoke(app, ["check", "--d-model", "32", "--n-heads", "4", "--json"])
    cli = json.loads(res.stdout)
    api = json.loads(json.dumps(tblock_cli.check(d_model=32, n_heads=4).to_dict()))
    for c in cli["checks"] + api["checks"]:
        c.pop("value"), c.pop("detail"), c.pop("facts"), c.pop("seconds")  # float noise and timings aside, the shapes must match
    assert cli.pop("seconds") > 0 and api.pop("seconds") > 0  # the battery's total wall time
    assert cli == api


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown option"):
        tblock_cli.check(d_modle=32)


def test_import_does_not_import_torch():
    code = "import sys, tblock_cli; assert 'torch' not in sys.modules; print(tblock_cli.__all__)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "check" in out and "assert_ok" in out
