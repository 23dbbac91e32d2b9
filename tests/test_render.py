"""What the views do where they are drawn: a narrow or zero-width terminal, an ASCII stream, a pipe."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from test_golden import bench_report, check_report, depth_report

from tblock_cli import render
from tblock_cli.render.common import make_console

ROOT = Path(__file__).parent.parent
SMALL = ["--d-model", "32", "--n-heads", "4", "--threads", "1"]


def tblock(*args, **env) -> subprocess.CompletedProcess:
    """The command as a user runs it, its stdout a pipe, with these environment variables."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-m", "tblock_cli", *args], capture_output=True, env=full, timeout=300)


def drawn(renderable, width: int = 100, encoding: str = "utf-8") -> str:
    stream = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    console = Console(file=stream, width=width, color_system=None, legacy_windows=False)
    console.print(renderable)
    stream.flush()
    return stream.buffer.getvalue().decode(encoding)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_bars_and_sparklines_fall_back_to_ascii(encoding):
    for view in (render.bench_view(bench_report()), render.depth_view(depth_report()),
                 render.depth_compare_view([depth_report(), depth_report()])):
        text = drawn(view, encoding=encoding)
        assert text.isascii() and "#" in text
    unicode = drawn(render.bench_view(bench_report()))
    assert "█" in unicode and "▁" in unicode


def invoke(monkeypatch, args, charset="utf-8", **env):
    """The CLI in this process, its consoles made as at start-up under these environment variables."""
    from typer.testing import CliRunner

    from tblock_cli import cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(cli, "out", make_console())
    monkeypatch.setattr(cli, "err", make_console(stderr=True))
    return CliRunner(charset=charset).invoke(cli.app, args)


@pytest.mark.parametrize("charset", ["ascii", "latin-1"])
def test_bench_and_depth_on_an_ascii_or_latin1_stream(monkeypatch, charset):
    """Before, both crashed with UnicodeEncodeError after measuring (check already fell back to ASCII boxes)."""
    res = invoke(monkeypatch, ["bench", *SMALL, "--seq", "4", "--mode", "infer", "--decode", "3", "--breakdown",
                               "--min-time", "0.01"], charset)
    assert res.exit_code == 0, res.output
    assert "#" in res.stdout and "decode" in res.stdout and "breakdown" in res.stdout and res.stdout.isascii()
    res = invoke(monkeypatch, ["depth", *SMALL, "--layers", "2", "--seq", "4"], charset)
    assert res.exit_code == 0, res.output
    assert "#" in res.stdout and res.stdout.isascii()


def test_a_pipe_with_zero_columns_and_ascii_gets_whole_unpadded_lines():
    """COLUMNS=0 printed nothing (exit 0); piped lines were padded with spaces to the terminal width."""
    res = tblock("params", *SMALL, COLUMNS="0", PYTHONIOENCODING="ascii")  # 0 columns taken as 80
    out = res.stdout.decode("ascii")
    assert res.returncode == 0 and "tblock params" in out and "ln1" in out and "total" in out
    lines = out.splitlines()
    assert all(line == line.rstrip() for line in lines) and max(map(len, lines)) <= 80


def test_zero_columns_still_print_the_error(monkeypatch):
    res = invoke(monkeypatch, ["check", "--d-model", "33", "--n-heads", "4"], COLUMNS="0")
    assert res.exit_code == 2 and res.stderr.startswith("error:") and "33" in res.stderr


def test_twenty_columns_keep_check_names_and_statuses(monkeypatch):
    res = invoke(monkeypatch, ["check", *SMALL], COLUMNS="20")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 20
    for name in ("shape", "finite", "residual", "batch"):
        assert any(line.split()[:2] == [name, "pass"] for line in lines if line.split()), name


def test_narrow_check_view_is_name_status_then_meaning():
    text = drawn(render.check_view(check_report()), width=30)
    assert max(map(len, text.splitlines())) <= 30
    rows = [line.split() for line in text.splitlines() if line.split()]
    for name, status in (("shape", "pass"), ("order", "warn"), ("padding", "fail"), ("kv_cache", "skip")):
        assert [name, status] in [r[:2] for r in rows], name


def test_make_console_width_floor(monkeypatch):
    monkeypatch.setenv("COLUMNS", "0")
    assert make_console().width >= 20
    monkeypatch.setenv("COLUMNS", "5")
    assert make_console().width == 20
    monkeypatch.setenv("COLUMNS", "120")
    assert make_console().width == 120


def test_check_view_keeps_every_name_status_and_value_whole_at_any_width():
    report = check_report()
    for width in range(20, 101, 2):
        text = drawn(render.check_view(report), width=width)
        assert "…" not in text and max(map(len, text.splitlines())) <= width, width
        rows = [line.split()[:2] for line in text.splitlines()]
        for c in report.checks:
            assert [c.name, c.status.value] in rows, (width, c.name)
