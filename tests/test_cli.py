"""The command line through Typer's CliRunner: exit codes, JSON, one-line errors, --strict."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli import __version__
from tblock_cli.cli import app

from conftest import zoo_spec

runner = CliRunner()
SMALL = ["--d-model", "32", "--n-heads", "4"]


def run(*args):
    return runner.invoke(app, list(args))


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.stdout


def test_help_does_not_import_torch():
    code = (
        "import sys; from typer.testing import CliRunner; from tblock_cli.cli import app; "
        "r = [CliRunner().invoke(app, a) for a in (['--help'], ['check', '--help'], ['params', '--help'], ['bench', '--help'], ['depth', '--help'])]; "
        "assert all(x.exit_code == 0 for x in r), [x.output for x in r]; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_json_shape_and_exit_zero():
    r = run("check", *SMALL, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] is True
    assert data["config"]["d_model"] == 32 and data["config"]["d_ff"] == 128
    assert set(data["environment"]) >= {"torch", "device", "dtype", "threads"}
    assert data["environment"]["torch"] == torch.__version__
    assert [c["name"] for c in data["checks"]][:3] == ["shape", "finite", "determinism"]
    assert data["schema_version"] == 1 and data["command"] == "check" and data["subject"] == "built-in pre-LN block"
    assert {c["status"] for c in data["checks"]} <= {"pass", "skip"}
    assert all(set(c) == {"name", "status", "value", "detail"} for c in data["checks"])


def test_check_table_renders():
    r = run("check", *SMALL)
    assert r.exit_code == 0
    for word in ("shape", "residual", "reference", "OK"):
        assert word in r.stdout


def test_failing_check_exits_one():
    r = run("check", *SMALL, "--eps", "0", "--json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["ok"] is False
    assert next(c for c in data["checks"] if c["name"] == "finite")["status"] == "fail"
    assert "warning: --eps 0" in r.stderr


def test_strict_turns_warnings_into_failure():
    spec = zoo_spec("NeedWeightsOn")
    assert run("check", *SMALL, "--block", spec).exit_code == 0
    r = run("check", *SMALL, "--block", spec, "--strict", "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False


@pytest.mark.parametrize(
    "args, words",
    [
        (["--d-model", "100", "--n-heads", "8"], "not divisible"),
        (["--batch", "0"], "--batch must be > 0"),
        (["--dropout", "1.5"], "--dropout"),
        (["--dtype", "float8"], "--dtype"),
        (["--device", "tpu"], "--device must be"),
        (["--norm", "sandwich"], "--norm"),
        (["--seq", "4000000", "--batch", "64"], "MiB"),
    ],
)
def test_bad_input_is_one_line_and_exit_two(args, words):
    r = run("check", *args)
    assert r.exit_code == 2, r.output
    assert words in r.stderr
    assert "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_a_clear_error():
    for dev in ("cuda", "cuda:7"):
        r = run("check", "--device", dev)
        assert r.exit_code == 2 and "no CUDA device" in r.stderr


def test_non_number_flag_is_usage_error():
    r = run("check", "--d-model", "wide")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_python_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "tblock_cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and __version__ in r.stdout


def test_cuda_index_beyond_the_devices_is_a_clear_error(monkeypatch):
    from tblock_cli.errors import ConfigError
    from tblock_cli.runtime import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="has 1 CUDA device"):
        resolve_device("cuda:7")


def test_unsupported_dtype_on_device_is_a_config_error(monkeypatch):
    from tblock_cli import runtime
    from tblock_cli.errors import ConfigError

    def broken(*a, **k):
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(torch.nn.functional, "layer_norm", broken)
    with pytest.raises(ConfigError, match="does not run on cpu"):
        runtime.resolve_dtype("float16", torch.device("cpu"))
