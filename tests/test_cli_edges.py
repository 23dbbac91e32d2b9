"""The command line at its edges: an empty check selection, --junit-xml over a file not its own, a --block path the
file system refuses, compare's own --help, bench --tp's one length and mode, a block that calls os._exit or
sys.exit, and foreign text with Rich markup in it."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tblock_cli.checks.battery import CHECK_NAMES, REGISTRY, select
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError

runner = CliRunner()
TESTS = Path(__file__).parent
ROOT = TESTS.parent
S = ["--d-model", "64", "--n-heads", "4", "--threads", "1", "--seq", "8"]


@pytest.mark.parametrize("flags", [["--only", ""], ["--only", ","], ["--only", "shape", "--skip", "shape"],
                                   ["--skip", ",".join(CHECK_NAMES)], ["--only", "dtype,kv_cache", "--skip", "dtype,kv_cache"]])
def test_no_check_selected_is_exit_2_not_an_empty_ok(flags):
    res = runner.invoke(app, ["check", *S, *flags])
    assert res.exit_code == 2, res.output
    assert "no check" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_fast_leaves_out_the_slow_checks_nobody_named():
    slow = {c.name for c in REGISTRY if c.slow}
    assert slow and not slow & set(select(fast=True))
    for name in slow:  # --only X --fast runs X
        assert select(only=name, fast=True) == (name,)
    with pytest.raises(ConfigError, match="no check selected"):
        select(skip=list(CHECK_NAMES))


def test_fast_with_only_a_slow_check_runs_it():
    res = runner.invoke(app, ["check", *S, "--only", "dtype", "--fast", "--json"])
    assert res.exit_code == 0, res.output
    import json

    assert [c["name"] for c in json.loads(res.stdout)["checks"]] == ["dtype"]


def test_junit_xml_refuses_to_overwrite_a_file_that_is_not_its_report(tmp_path):
    precious = tmp_path / "notes.xml"
    precious.write_text("<notes>keep me</notes>\n")
    res = runner.invoke(app, ["check", *S, "--only", "shape", "--junit-xml", str(precious)])
    assert res.exit_code == 2 and "refusing to overwrite" in res.stderr
    assert precious.read_text() == "<notes>keep me</notes>\n"
    ours = tmp_path / "report.xml"
    for _ in range(2):  # written, then replaced: a report of ours may be overwritten
        res = runner.invoke(app, ["check", *S, "--only", "shape", "--junit-xml", str(ours)])
        assert res.exit_code == 0, res.output
    import xml.etree.ElementTree as ET

    assert [c.get("name") for c in ET.parse(ours).getroot().iter("testcase")] == ["shape"]


@pytest.mark.parametrize("spec", ["/tmp/" + "a" * 5000 + ".py:Block", "x/" + "b" * 5000 + ":Block", "c" * 5000 + ":Block"],
                         ids=["file", "folder", "module"])
def test_a_block_path_too_long_for_the_file_system_is_one_line(spec):
    res = runner.invoke(app, ["check", *S, "--block", spec])
    assert res.exit_code == 2, res.exception
    assert len(res.stderr.strip().splitlines()) == 1 and "File name too long" in res.stderr


def test_compare_help_lists_only_what_compare_takes():
    res = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert "--kwargs-a" in res.output and "--dtype-b" in res.output
    assert "--block " not in res.output and "--kwargs " not in res.output
    res = runner.invoke(app, ["compare", "builtin", "builtin", "--block", "x.py:Y"])
    assert res.exit_code == 2 and "No such option" in res.stderr


@pytest.mark.parametrize("flags, words", [(["--seq", "8,16"], "one sequence length"), (["--mode", "infer"], "drop --mode infer"),
                                          (["--mode", "both"], "drop --mode both")])
def test_bench_tp_refuses_what_it_would_ignore(flags, words):
    res = runner.invoke(app, ["bench", *S[:-2], "--tp", "2", *flags])
    assert res.exit_code == 2 and words in res.stderr, res.output


def _run(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tblock_cli", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


@pytest.mark.parametrize("name, code", [("OsExitInForward", 2), ("SysExitInForward", 2), ("OsExitAfterLoading", 1)])
def test_a_block_that_exits_never_ends_tblock_with_success(name, code):
    """os._exit runs no atexit hook and no finally: before, `check` ended with exit 0 and printed nothing."""
    res = _run("check", *S, "--only", "shape,finite", "--block", f"{TESTS / 'edge_exits.py'}:{name}")
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "exit" in (res.stdout + res.stderr)


def test_a_block_that_exits_at_import_is_a_load_error(tmp_path):
    path = tmp_path / "exits_at_import.py"
    path.write_text("import os\nos._exit(0)\n")
    res = _run("params", *S, "--block", f"{path}:Block")
    assert res.returncode == 2 and "os._exit(0)" in res.stderr, (res.returncode, res.stderr)


def test_foreign_text_with_markup_is_printed_literally():
    """Every gloo error starts with `[/path/pair.cc:537]`: Rich read it as a closing tag and raised MarkupError."""
    from rich.console import Console

    from tblock_cli import render
    from tblock_cli.checks.result import CheckReport, CheckResult
    from tblock_cli.report import RunInfo, Status

    gloo = "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:391"
    report = CheckReport((CheckResult("tensor_parallel", Status.ERROR, None, "error.raised", {"error": gloo}),), False,
                         RunInfo("[/x] block", {}, {"torch": "2", "device": "cpu", "dtype": "float32", "threads": 1}, ()))
    console = Console(file=io.StringIO(), width=240, color_system=None)
    console.print(render.check_view(report))
    text = "".join(console.file.getvalue().split())
    assert "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537]" in text and "[/x]block" in text


def test_a_rank_that_dies_under_tp_keeps_the_report():
    """Before, rank 0's gloo error (starting `[/__w/pytorch/...]`) crashed the table with a Rich MarkupError."""
    res = runner.invoke(app, ["check", *S, "--causal", "--block", f"{TESTS / 'edge_exits.py'}:DiesOnRank1", "--tp", "2",
                              "--only", "shape,tensor_parallel"], env={"COLUMNS": "200"})
    assert res.exit_code == 1, (res.output, res.exception)
    assert "tensor_parallel" in res.stdout and "died with exit code 3" in res.stdout, res.stdout
