"""What keeps check cheap on big layers does not change what it computes: the streamed float64 reference equals
a whole float64 copy, the gradient states equal the gradients' own, the selection of checks is validated."""

import copy

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.checks.battery import CHECK_NAMES, select
from tblock_cli.checks.gradients import grad_state
from tblock_cli.config import build_config
from tblock_cli.errors import ConfigError
from tblock_cli.loading import make_subject
from tblock_cli.probes import float64_streamed, residual_probes, stream_units

CPU = torch.device("cpu")


def test_streamed_float64_equals_a_float64_copy_and_restores_the_block(monkeypatch):
    import tblock_cli.probes as probes

    monkeypatch.setattr(probes, "STREAM_UNIT_BYTES", 1024)  # small units even at d_model 32: streaming happens
    cfg = build_config(d_model=32, n_heads=4, layers=2)
    block = make_subject(cfg, CPU, torch.float32).module.eval()
    units = stream_units(block)
    assert len(units) > 3 and block not in units  # cast piece by piece, not whole
    before = {k: v.clone() for k, v in block.state_dict().items()}
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = copy.deepcopy(block).double()(x)
        with float64_streamed(block, CPU):
            got = block(x)
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    after = block.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert not block._forward_hooks and not block._forward_pre_hooks


def test_grad_state_matches_the_gradient():
    assert grad_state(None) == "none"
    assert grad_state(torch.zeros(3)) == "zero"
    assert grad_state(torch.tensor([0.0, 1.0])) == "ok"
    assert grad_state(torch.tensor([1.0, float("nan")])) == "nonfinite"
    assert grad_state(torch.tensor([float("inf"), float("-inf")])) == "nonfinite"  # sums to NaN
    assert grad_state(torch.tensor([3e38, 3e38])) == "ok"  # the sum overflows, the elements are finite


def test_residual_probes_keep_eight_at_the_default_input_and_fewer_on_big_ones():
    assert residual_probes(2 * 10 * 32) == 8 and residual_probes(2 * 10 * 512) == 8
    assert residual_probes(2 * 10 * 1024) == 4 and residual_probes(2 * 10 * 4096) == 1


def test_selection_only_skip_fast():
    assert select() is None
    assert select(only="shape,finite") == ("shape", "finite")
    assert "dtype" not in select(skip=["dtype"]) and len(select(skip=["dtype"])) == len(CHECK_NAMES) - 1
    fast = select(fast=True)
    assert "kv_cache" not in fast and "dtype" not in fast and "residual" in fast
    with pytest.raises(ConfigError, match="did you mean residual"):
        select(only="residal")


def test_only_runs_the_named_checks_and_reports_a_total():
    report = tblock_cli.check(d_model=32, n_heads=4, threads=1, only=["shape", "residual"])
    assert [c.name for c in report.checks] == ["shape", "residual"]
    assert report.seconds >= sum(c.seconds for c in report.checks) > 0


def test_progress_hears_checks_and_probes():
    heard = []
    tblock_cli.check(d_model=32, n_heads=4, threads=1, only="residual,dtype", progress=lambda n, d=None: heard.append((n, d)))
    assert ("residual", None) in heard and ("dtype", "float64 forward") in heard
    assert any(n == "residual" and d and "Jacobian" in d for n, d in heard)


def test_cli_refuses_a_misspelt_check_with_exit_2():
    from tblock_cli.cli import app

    res = CliRunner().invoke(app, ["check", "--d-model", "32", "--n-heads", "4", "--skip", "kv_cach"])
    assert res.exit_code == 2 and "kv_cache" in res.stderr


@pytest.mark.xdist_group("hf")  # with the other transformers tests (tests/test_hf.py)
def test_hf_init_once_keeps_what_transformers_init_writes():
    pytest.importorskip("transformers")
    from transformers import AutoModel

    from tblock_cli import hf
    from tblock_cli.hf.init import _marked, from_config_once

    config = hf.build_config("llama", build_config(d_model=32, n_heads=4), {})
    torch.manual_seed(0)
    model = from_config_once(AutoModel, config)
    assert not _marked(model)
    w = model.layers[0].mlp.gate_proj.weight
    assert abs(w.std().item() - config.initializer_range) < 0.005  # transformers' normal_(0, 0.02), not kaiming

    class Custom(nn.Module):  # a parameter only torch's default init writes: the build starts over
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class Auto:
        @staticmethod
        def from_config(_config):
            return Custom()

    assert not _marked(from_config_once(Auto, None))


def test_check_and_bench_do_not_import_sympy_or_inductor():
    """torch imports sympy for symbolic shapes (an explicit gradient to backward() checks its shape with them), and
    torch.profiler.profile imports inductor: 3-5 s of a command's start-up, and neither is needed."""
    import subprocess
    import sys

    code = ("import sys, tblock_cli; tblock_cli.check(d_model=32, n_heads=4, threads=1, only='padding,residual,grad_input'); "
            "print('sympy' in sys.modules, 'torch._inductor' in sys.modules); "
            "tblock_cli.bench(d_model=32, n_heads=4, threads=1, seq=[8], mode='train', min_time=0.01, breakdown=True); "
            "print('sympy' in sys.modules, 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False False", "False False"], out
