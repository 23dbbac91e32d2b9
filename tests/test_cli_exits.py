"""The edges of the process and of the command line: exits, signals, file descriptors, parse errors, bad types."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.nn as nn
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError

from conftest import zoo_spec

REPO = Path(__file__).parent.parent
EDGE = Path(__file__).parent / "edge_blocks.py"
SMALL = ["--d-model", "32", "--n-heads", "4", "--threads", "1"]
runner = CliRunner()


def edge(name: str) -> str:
    return f"{EDGE}:{name}"


def tblock(*args, env=None, **kw):
    """The real process: python -m tblock_cli, our tree first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "tblock_cli", *args], capture_output=True, text=True, env=env, **kw)


# --- a block that calls sys.exit is an error like any other exception

@pytest.mark.parametrize("name, words", [("ExitsInTraining", "SystemExit: 0"), ("ExitsWithMessage", "the block gave up")])
def test_sys_exit_in_training_forward_is_an_error_result(name, words):
    r = runner.invoke(app, ["check", *SMALL, "--block", edge(name), "--json"])
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    errors = [c for c in data["checks"] if c["status"] == "error"]
    assert errors and all(words in c["detail"] for c in errors)
    assert {"input_unchanged", "train_eval"} <= {c["name"] for c in errors}  # training forwards, caught by the runner


def test_sys_exit_while_benchmarking_is_exit_one_and_one_line():
    r = runner.invoke(app, ["bench", *SMALL, "--block", edge("ExitsInTraining"), "--seq", "8", "--mode", "train",
                            "--min-time", "0.01"])
    assert r.exit_code == 1, r.output
    assert "SystemExit" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- SIGINT: exit 130 and one line, wherever it lands

def _wait_for_torch(pid: int, timeout: float = 120.0) -> None:
    """Until the process has mapped libtorch: it is importing torch (or done), so tblock's code is running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/maps") as f:
            if "libtorch" in f.read():
                return
        time.sleep(0.01)
    raise AssertionError("torch never loaded")


def _wait_for_forwards(path: Path, count: int, timeout: float = 120.0) -> None:
    """Until the block has run `count` forwards: past bench's one profiled warm-up, inside the timed samples."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} forwards ran")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see when torch loads")
@pytest.mark.parametrize("during", ["import", "measuring"])  # while torch is being imported; while timing samples
def test_sigint_exits_130_with_one_line(during, tmp_path):
    forwards = tmp_path / "forwards"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLOW_FORWARDS": str(forwards)}
    # SIGINT back to its default in the child: a pytest started in the background by a non-interactive shell
    # ignores SIGINT, Python then leaves it ignored, and the command ran its full minute.
    p = subprocess.Popen([sys.executable, "-m", "tblock_cli", "bench", *SMALL, "--block", edge("Slow"), "--seq", "8",
                          "--min-time", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_torch(p.pid)
        if during == "measuring":
            _wait_for_forwards(forwards, 4)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["interrupted"], err
    assert during == "measuring" or not forwards.exists()  # the first really landed before the block ran


# --- a block writing to file descriptor 1 leaves --json intact

def test_writes_to_fd_1_go_to_stderr_under_json(capfd):
    """The block writes to the real descriptor 1 (pytest's capture file here, a pipe or terminal in use)."""
    fd1 = os.fstat(1)
    r = runner.invoke(app, ["params", *SMALL, "--block", edge("WritesToFd1"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["command"] == "params"
    written = capfd.readouterr()
    assert "raw bytes on fd 1" in written.err and "raw bytes" not in written.out
    now = os.fstat(1)
    assert (now.st_dev, now.st_ino) == (fd1.st_dev, fd1.st_ino)  # descriptor 1 is itself again after the command


# --- parse errors: one line, exit 2

@pytest.mark.parametrize("args", [["check", "--d-model", "1e3"], ["bench", "--batch", "2.5"], ["check", "--foo"]])
def test_parse_errors_are_one_line_exit_two(args):
    r = tblock(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and args[1] in lines[0], r.stderr
    assert "╭" not in r.stderr and "Traceback" not in r.stderr


# --- every flag value judged before torch is imported

def test_bad_flag_values_are_refused_before_torch_is_imported():
    bad = [["check", "--dtype", "float8"], ["params", "--d-model", "-4"], ["depth", "--norm", "sandwich"],
           ["check", "--device", "tpu"], ["bench", "--d-model", "100", "--n-heads", "8"], ["check", "--preset", "gpt5"],
           ["check", "--block", "x.py:A", "--threads", "0"], ["params", "--tree-depth", "0"], ["check", "--eps", "nan"],
           ["bench", "--mode", "fast"], ["bench", "--seq", "8,x"], ["bench", "--seq", "8,99999999"], ["bench", "--min-time", "0"],
           ["bench", "--decode", "0"], ["bench", "--baseline", "tf"], ["check", "--kwargs", "{}"],
           ["check", "--block", "x.py:A", "--kwargs", "[1"], ["check", "--block", "x.py:A", "--preset", "gpt5"]]
    exits_2_in_one_line_without_torch(bad)


# --- help: switches without a type, names never cut, hf:TYPE named

def test_switches_show_no_type_and_block_help_names_hf():
    r = runner.invoke(app, ["check", "--help"])
    assert "<bool>" not in r.stdout
    flat = " ".join(r.stdout.replace("│", " ").split())
    assert "hf:TYPE" in flat


@pytest.mark.parametrize("command", ["check", "bench"])
def test_flag_names_are_whole_at_60_columns(command):
    r = tblock(command, "--help", env={"COLUMNS": "60"})
    assert r.returncode == 0
    assert "--no-positional" in r.stdout and "…" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) <= 60


# --- --pad-keyword checked at load time; user-only and built-in-only flags warn

def test_pad_keyword_naming_the_input_or_nothing_is_refused_at_load():
    for kw in ("x", "nothere"):
        r = runner.invoke(app, ["check", *SMALL, "--block", edge("MaskFirst"), "--pad-keyword", kw])
        assert r.exit_code == 2, r.output
        assert f"--pad-keyword {kw}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["params", *SMALL, "--block", edge("MaskFirst"), "--pad-keyword", "mask", "--json"])
    assert r.exit_code == 0, r.output


def test_padding_flags_on_the_builtin_block_warn():
    r = runner.invoke(app, ["params", *SMALL, "--pad-keyword", "mask", "--pad-means", "keep", "--json"])
    assert r.exit_code == 0
    assert "--pad-keyword, --pad-means" in r.stderr and "built-in block" in r.stderr


def test_depth_norm_with_a_user_block_warns():
    r = runner.invoke(app, ["depth", *SMALL, "--layers", "2", "--block", zoo_spec("Good"), "--norm", "post", "--json"])
    assert r.exit_code == 0, r.output
    assert "--norm" in r.stderr and "only the built-in block" in r.stderr


# --- --block SPEC messages name the real problem

def test_block_spec_that_is_not_python_says_so(tmp_path):
    text = tmp_path / "notpy.txt"
    text.write_text("A = 1\n")
    for spec, words in [(f"{text}:A", "not a .py file"), ("/etc/passwd:X", "not a .py file"),
                        ("notpy.txt:A", "not a .py file and not an importable module"), (f"{tmp_path}:A", "is a folder")]:
        r = runner.invoke(app, ["check", "--block", spec])
        assert r.exit_code == 2 and words in r.stderr, (spec, r.stderr)


# --- params --list-presets --json is an envelope

def test_list_presets_json_is_the_standard_envelope():
    r = runner.invoke(app, ["params", "--list-presets", "--json"])
    data = json.loads(r.stdout)
    assert (data["schema_version"], data["command"], data["ok"]) == (1, "params", True)
    assert data["presets"]["gpt2-small"]["d_model"] == 768


# --- the API: wrong types are ConfigErrors naming the option

def tel():
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)


@pytest.mark.parametrize("call, options, name", [
    (tblock_cli.check, {"d_model": "64"}, "--d-model"), (tblock_cli.check, {"seq": [1, 2]}, "--seq"),
    (tblock_cli.check, {"batch": True}, "--batch"), (tblock_cli.check, {"d_model": 64.0}, "--d-model"),
    (tblock_cli.check, {"dropout": "0.1"}, "--dropout"), (tblock_cli.params, {"tree_depth": "2"}, "--tree-depth"),
    (tblock_cli.check, {"strict": "yes"}, "--strict"), (tblock_cli.bench, {"need_weights": 1}, "--need-weights"),
    (tblock_cli.bench, {"seq": [8, "16"]}, "--seq"), (tblock_cli.depth, {"causal": "no"}, "--causal"),
    (tblock_cli.check, {"progress": "bar"}, "progress"), (tblock_cli.bench, {"compare_with": "old.json"}, "compare_with"),
])
def test_api_type_errors_are_config_errors_naming_the_option(call, options, name):
    with pytest.raises(ConfigError, match=name):
        call(tel(), **options)


def test_assert_ok_on_something_else_is_a_config_error():
    with pytest.raises(ConfigError, match="assert_ok"):
        tblock_cli.assert_ok(None)


# COLUMNS=0 in a real pipe: tests/test_render.py's test_a_pipe_with_zero_columns_and_ascii_gets_whole_unpadded_lines


@pytest.mark.xdist_group("hf")  # with the other transformers tests (tests/test_hf.py)
def test_layers_with_an_hf_block_builds_them_and_does_not_warn():
    pytest.importorskip("transformers")
    r = tblock_cli.params("hf:llama", d_model=32, n_heads=4, d_ff=64, layers=2)
    assert not any("--layers" in w for w in r.run.warnings)
    assert r.to_dict()["total"] == 2 * tblock_cli.params("hf:llama", d_model=32, n_heads=4, d_ff=64).to_dict()["total"]


def test_compare_flags_are_refused_before_torch_is_imported():
    """compare's own rules live in the same front door as the other commands' (options.compare)."""
    bad = [["compare", "builtin", "x.py:A", "--kwargs", "{}"], ["compare", "x.py:A", "x.py:B", "--kwargs", "[1"],
           ["compare", "builtin", "builtin", "--d-model", "100", "--n-heads", "8"], ["compare", "builtin", "--compile", "--backend", "tvm"],
           ["compare", "builtin", "builtin", "--atol", "-1"], ["compare", "builtin", "builtin", "--backend", "eager"],
           ["compare", "builtin"], ["compare", "builtin", "builtin", "--dtype-b", "float8"]]
    exits_2_in_one_line_without_torch(bad)


def exits_2_in_one_line_without_torch(bad: list[list[str]]) -> None:
    """Each argument list, in one process where torch is never imported: exit 2 and one line on stderr each."""
    code = ("import sys\nfrom tblock_cli.cli import main\ncodes = []\n"
            f"for args in {bad!r}:\n"
            "    try:\n        main(args)\n    except SystemExit as e:\n        codes.append(e.code)\n"
            "print(codes, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.stdout.strip() == f"{[2] * len(bad)} False", (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == len(bad)
