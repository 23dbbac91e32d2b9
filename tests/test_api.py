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


# --- the caller's module comes back as it went in: dtype, device, modes, weights, gradients; threads too

def _snapshot(module):
    return ({k: v.clone() for k, v in module.state_dict().items()}, [m.training for m in module.modules()],
            [p.grad for p in module.parameters()])


def _assert_unchanged(module, before):
    state, modes, grads = before
    now = module.state_dict()
    assert all(now[k].dtype == v.dtype and now[k].device == v.device and torch.equal(now[k], v) for k, v in state.items())
    assert [m.training for m in module.modules()] == modes
    assert all(p.grad is g for p, g in zip(module.parameters(), grads))


@pytest.mark.parametrize("run", [
    lambda m: tblock_cli.check(m, dtype="bfloat16", seq=6, threads=2),
    lambda m: tblock_cli.check(m, seq=6),
    lambda m: tblock_cli.params(m, dtype="float16", seq=6, threads=2),
    lambda m: tblock_cli.bench(m, seq=[6], mode="train", min_time=0.01, threads=2),
    lambda m: tblock_cli.depth(m, layers=2, seq=6, threads=2),
], ids=["check-bf16", "check", "params-f16", "bench-train", "depth"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_api_leaves_the_callers_module_and_threads_as_they_were(run, dtype):
    module = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.BatchNorm1d(6), nn.Dropout(0.1)).to(dtype)  # BatchNorm over the 6 tokens
    module.train()
    module[3].eval()  # a mixed state: one part in eval inside a training module
    before, threads = _snapshot(module), torch.get_num_threads()
    run(module)
    _assert_unchanged(module, before)
    assert torch.get_num_threads() == threads


def test_threads_and_modes_are_restored_when_the_block_raises():
    from tblock_cli.errors import MeasureError

    threads = torch.get_num_threads()
    module = zoo.FailsWithGrad(32, 4)
    module.train()
    with pytest.raises(MeasureError):
        tblock_cli.depth(module, layers=2, seq=6, threads=3)
    assert torch.get_num_threads() == threads and module.training


# --- one front door: the API's own signatures, each option rule once and torch-free

def test_the_package_exports_the_api_functions_with_their_real_keywords():
    import inspect

    from tblock_cli import api

    for name in ("check", "params", "bench", "depth", "compare", "assert_ok"):
        assert getattr(tblock_cli, name) is getattr(api, name)  # one function, one docstring
    assert {"strict", "only", "skip", "fast", "tp", "fsdp", "tp_plan", "progress"} <= set(inspect.signature(tblock_cli.check).parameters)
    assert {"seq", "mode", "min_time", "decode", "breakdown"} <= set(inspect.signature(tblock_cli.bench).parameters)
    assert {"kwargs_a", "dtype_b", "atol", "backend"} <= set(inspect.signature(tblock_cli.compare).parameters)


@pytest.mark.parametrize("call, says", [
    ("params(tree_depth=0)", "--tree-depth must be >= 1"),
    ("check(tp_plan='plan.json')", "--tp-plan needs --tp"),
    ("bench(mode='fast')", "--mode must be"),
    ("compare('builtin', 'builtin', atol=-1.0)", "--atol must be >= 0"),
    ("compare('builtin', 'builtin', backend='inductor')", "needs --compile"),
    ("depth(compare=True, norm='pre')", "drop --norm"),
    ("check(d_model=100, n_heads=8)", "not divisible"),
], ids=["tree_depth", "tp_plan", "mode", "atol", "backend", "depth-compare", "heads"])
def test_an_option_rule_answers_before_torch_is_imported(call, says):
    """The same refusals the CLI gives, from the API, in a process where torch never loads."""
    code = (f"import sys, tblock_cli\nfrom tblock_cli.errors import ConfigError\ntry:\n    tblock_cli.{call}\n"
            f"except ConfigError as e:\n    print(str(e))\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.splitlines()
    assert out[-1] == "False" and says in out[0], out


def test_a_user_modules_by_design_attribute_changes_no_verdict():
    """`by_design` is tblock's own knowledge of an hf: family, held on its wrapper: a user block with an attribute of
    that name (here: every failing kind and every check's skip claimed "by design") is judged exactly as without it."""

    class Claims(zoo.NoResidual):
        def __init__(self, *a):
            super().__init__(*a)
            self.by_design = {}

    plain = tblock_cli.check(zoo.NoResidual(32, 4), threads=1)
    claims = Claims(32, 4)
    claims.by_design = {c.kind: "by design" for c in plain.checks} | {f"{c.name}.skip": "by design" for c in plain.checks}
    torch.manual_seed(0)
    plain = tblock_cli.check(zoo.NoResidual(32, 4), threads=1)
    torch.manual_seed(0)
    claimed = tblock_cli.check(claims, threads=1)
    assert [(c.name, c.status, c.kind) for c in claimed.checks] == [(c.name, c.status, c.kind) for c in plain.checks]
    assert not claimed.ok and "by_design" not in {c.kind for c in claimed.checks}
