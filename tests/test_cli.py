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
    assert all(set(c) == {"name", "status", "value", "detail", "kind", "facts", "seconds", "passes"} for c in data["checks"])
    assert all(c["kind"].startswith(c["name"] + ".") for c in data["checks"])


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


REPO = __import__("pathlib").Path(__file__).parent.parent


@pytest.mark.parametrize("command", [["check"], ["params"], ["depth", "--layers", "2"],
                                     ["bench", "--seq", "8", "--mode", "infer", "--min-time", "0.01"]])
def test_a_printing_block_keeps_json_valid(command):
    r = run(*command, *SMALL, "--block", zoo_spec("Printing"), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["command"] == command[0] and "forward of Printing" in r.stderr


BAD_FLAGS = [
    (["--eps", "inf"], "--eps must be a finite number"),
    (["--eps", "nan"], "--eps must be a finite number"),
    (["--dropout", "nan"], "--dropout"),
    (["--seed", str(2**70)], "--seed must be in"),
    (["--seed", "-1"], "--seed must be in"),
    (["--d-model", "1000000000000"], "--d-model must be at most"),
    (["--threads", "0"], "--threads"),
    (["--pad-means", "maybe"], "--pad-means"),
    (["--kwargs", "{}"], "--block"),
]


@pytest.mark.parametrize("command, args, words", [
    (command, args, words) for command in ("check", "params", "depth") for args, words in BAD_FLAGS
    if not (command == "depth" and args[0] == "--pad-means")  # depth has no padding flags
])
def test_more_bad_input_is_one_line_and_exit_two(command, args, words):
    r = run(command, *args)
    assert r.exit_code == 2, r.output
    assert words in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_block_file_that_exits_is_a_load_error(tmp_path):
    f = tmp_path / "exits.py"
    f.write_text("import sys\nsys.exit(3)\n")
    r = run("check", "--block", f"{f}:X")
    assert r.exit_code == 2 and "SystemExit: 3" in r.stderr


def test_cpu_allocation_failure_is_out_of_memory_exit_two():
    for command in ("check", "params"):
        r = run(command, *SMALL, "--block", zoo_spec("AllocationFails"))
        assert r.exit_code == 2 and "out of memory" in r.stderr and "Traceback" not in r.output


def test_module_spec_from_the_current_folder_like_python_m(monkeypatch):
    """The console script does not put the current folder on sys.path; tblock does, as python -m would."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(REPO))])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(REPO)
    r = run("params", "--block", "examples.my_block:MyBlock", "--d-model", "64", "--n-heads", "4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["subject"] == "examples.my_block:MyBlock"


def test_plot_to_an_unwritable_place_fails_before_measuring(tmp_path):
    for target in ("/proc/x.png", str(tmp_path)):
        r = run("depth", *SMALL, "--layers", "2", "--plot", target)
        assert r.exit_code == 2 and "--plot" in r.stderr and "act RMS" not in r.stdout


def test_help_escapes_rich_markup():
    r = run("bench", "--help")
    assert "tblock[plot]" in r.stdout.replace("\n", " ").replace("│", " ").replace("  ", " ")


@pytest.mark.parametrize("args, words", [(["params", "--tree-depth", "0"], "--tree-depth must be >= 1"),
                                         pytest.param(["check", "--block", "hf:"], "needs a transformers model type",
                                                      marks=pytest.mark.xdist_group("hf"))])  # imports transformers
def test_params_and_hf_flag_errors_are_one_line(args, words):
    if args[-1] == "hf:":
        pytest.importorskip("transformers")
    r = run(*args)
    assert r.exit_code == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
