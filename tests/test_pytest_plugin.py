"""The pytest plugin, run through pytester on examples/sample_repo: one item per check, -k, --junit-xml, -n 2,
--strict-markers, a planted bug caught by exactly the checks that catch it, `pytest --tblock SPEC`."""

import importlib.metadata
import os
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

import tblock_cli
from tblock_cli.checks.battery import CHECK_NAMES
from tblock_cli.pytest_plugin import with_needs

pytest_plugins = ["pytester"]

ROOT = Path(__file__).parent.parent
SAMPLE = ROOT / "examples" / "sample_repo"
ZOO = Path(__file__).parent / "zoo.py"
# Installed, the entry point loads the plugin in every run; from a checkout not installed since, `-p` loads it (both
# at once would register it twice).
INSTALLED = any(ep.name == "tblock" for ep in importlib.metadata.entry_points(group="pytest11"))
PLUGIN = () if INSTALLED else ("-p", "tblock_cli.pytest_plugin")
# This module imports the plugin too: pytest then warns that it cannot rewrite its asserts (it has none).
QUIET = (*PLUGIN, "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
SAMPLE_OPTIONS = dict(d_model=64, n_heads=4, causal=True)  # what tests/test_block.py declares


def run(pytester, *args):
    return pytester.runpytest(*QUIET, *args)


@pytest.fixture
def sample(pytester, monkeypatch):
    """The sample repository copied into pytester's folder; subprocesses (xdist's workers) import this tblock_cli."""
    shutil.copytree(SAMPLE, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # The sample's tests/test_block.py is collected in this process: a worker that already imported tblock's own
    # tests/test_block.py under that basename would refuse it as a file mismatch.
    for name in ("test_block", "my_block"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return pytester


def outcomes(path: Path) -> dict[str, str]:
    """test name -> passed / failure / skipped / error, read from a JUnit XML file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = [c.tag for c in case if c.tag in ("failure", "skipped", "error")]
        out[case.get("name")] = tags[0] if tags else "passed"
    return out


def junit_status(status: str, strict: bool = False) -> str:
    """What a check's status becomes as a pytest outcome, stated from the plugin's rule."""
    return {"pass": "passed", "warn": "failure" if strict else "passed", "fail": "failure", "error": "failure",
            "skip": "skipped"}[status]


def test_the_entry_point_is_declared():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    assert entry == {"tblock": "tblock_cli.pytest_plugin"}


def test_the_sample_test_file_is_three_lines():
    assert len((SAMPLE / "tests" / "test_block.py").read_text().strip().splitlines()) == 3


def test_loading_the_plugin_imports_no_torch(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_clean="import sys\n\ndef test_no_torch():\n    assert 'torch' not in sys.modules\n")
    result = pytester.runpytest_subprocess(*QUIET, "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    assert "--tblock=SPEC" in pytester.runpytest_subprocess(*QUIET, "--help").stdout.str()


def test_one_item_per_check(sample):
    result = run(sample, "--collect-only", "-q")
    collected = [line for line in result.outlines if "::" in line]
    assert collected == [f"tests/test_block.py::test_block[{n}]" for n in CHECK_NAMES]


def test_each_item_has_the_api_verdict_and_junit_lists_them(sample):
    result = run(sample, "--junit-xml=report.xml", "-rs")
    truth = tblock_cli.check(f"{sample.path / 'my_block.py'}:Block", **SAMPLE_OPTIONS)
    got = outcomes(sample.path / "report.xml")
    assert got == {f"test_block[{c.name}]": junit_status(c.status.value) for c in truth.checks}
    assert result.ret == 0
    skip = next(c for c in truth.checks if c.status.value == "skip")
    assert f"tests/test_block.py:3: {skip.name}: {skip.detail}" in result.stdout.str()  # the skip's reason, at the test


def test_k_selects_one_check(sample):
    result = run(sample, "-k", "padding", "--junit-xml=report.xml")
    result.assert_outcomes(passed=1, deselected=len(CHECK_NAMES) - 1)
    assert outcomes(sample.path / "report.xml") == {"test_block[padding]": "passed"}


def test_a_planted_bug_fails_exactly_the_checks_that_catch_it(sample):
    block = sample.path / "my_block.py"
    source = block.read_text()
    mask = "allowed = allowed & ~pad_mask[:, None, None, :]"
    assert mask in source
    block.write_text(source.replace(mask, "pass  # the padding mask is ignored"))
    result = run(sample, "--junit-xml=report.xml")
    got = outcomes(sample.path / "report.xml")
    assert {n for n, o in got.items() if o == "failure"} == {"test_block[padding]"}
    truth = tblock_cli.check(f"{block}:Block", **SAMPLE_OPTIONS)
    (failing,) = truth.failing
    assert failing.name == "padding"
    assert f"tblock padding: fail: {failing.detail}" in result.stdout.str()
    assert f"kind: {failing.kind}" in result.stdout.str()
    assert result.ret == 1
    selected = run(sample, "-k", "padding")  # the checks padding waits for, and padding: the same verdict
    selected.assert_outcomes(failed=1, deselected=len(CHECK_NAMES) - 1)


def test_k_runs_the_selected_checks_and_those_their_verdicts_wait_for():
    # padding needs shape, finite, deterministic (COMPARES), finite, input_kept (GRADS) and independent (batch)
    assert with_needs(["padding"], CHECK_NAMES) == ("shape", "finite", "determinism", "input_unchanged", "batch", "padding")
    assert with_needs(["padding"], ("padding", "batch")) == ("padding", "batch")  # never one the user left out


def test_xdist_runs_the_same_items(sample):
    result = run(sample, "-p", "xdist", "-n", "2", "-k", "shape or padding or causal", "--junit-xml=report.xml")
    assert outcomes(sample.path / "report.xml") == {"test_block[shape]": "passed", "test_block[padding]": "passed",
                                                    "test_block[causal]": "passed"}
    assert result.ret == 0


def test_a_marked_test_under_strict_markers(pytester):
    pytester.makepyfile(test_marked="""
        import pytest

        @pytest.mark.tblock(None, d_model=32, n_heads=4, only="shape,residual")
        def test_builtin(tblock_check):
            assert tblock_check.status.value == "pass"
            assert tblock_check.name in ("shape", "residual")
    """)
    result = run(pytester, "--strict-markers", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_builtin?shape? PASSED*", "*test_builtin?residual? PASSED*"])


def test_the_block_is_built_once_for_all_its_items(pytester, tmp_path):
    """A run of the items builds the block as often as one tblock_cli.check does (the battery's own copies)."""
    log = tmp_path / "built.txt"
    pytester.makepyfile(counted=f"""
        import sys
        sys.path.insert(0, {str(ZOO.parent)!r})
        from zoo import Good

        class Counted(Good):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                with open({str(log)!r}, "a") as f:
                    f.write("built\\n")
    """, test_counted="""
        from counted import Counted
        from tblock_cli.pytest_plugin import check_items
        test_counted = check_items(Counted, d_model=32, n_heads=4)
    """)
    result = run(pytester)
    assert result.ret == 0
    by_items = len(log.read_text().splitlines())
    log.unlink()
    sys.path.insert(0, str(pytester.path))
    try:
        tblock_cli.check(f"{pytester.path / 'counted.py'}:Counted", d_model=32, n_heads=4)
    finally:
        sys.path.remove(str(pytester.path))
    by_api = len(log.read_text().splitlines())
    assert by_items == by_api


def test_tblock_option_collects_a_spec_without_a_test_file(pytester):
    result = run(pytester, "--tblock", f"{ZOO}:NoResidual", "--tblock", "builtin", "--tblock-d-model", "32",
                 "--tblock-n-heads", "4", "--tblock-only", "shape,residual", "--junit-xml=report.xml")
    got = outcomes(pytester.path / "report.xml")
    assert got == {f"{ZOO}:NoResidual[shape]": "passed", f"{ZOO}:NoResidual[residual]": "failure",
                   "builtin[shape]": "passed", "builtin[residual]": "passed"}
    result.stdout.fnmatch_lines(["collected 4 items"])
    assert run(pytester, "--tblock", "builtin", "--tblock-only", "shape", "-m", "tblock").ret == 0  # marked as tblock's
    skipped = run(pytester, "--tblock", "builtin", "--tblock-only", "shape,order", "--tblock-causal", "-rs")
    skipped.assert_outcomes(passed=1, skipped=1)  # a skip with no test file behind it: reported, no internal error
    assert "INTERNALERROR" not in skipped.stdout.str() + skipped.stderr.str()
    truth = tblock_cli.check(f"{ZOO}:NoResidual", d_model=32, n_heads=4, only="shape,residual")
    residual = next(c for c in truth.checks if c.name == "residual")
    assert f"tblock residual: fail: {residual.detail}" in result.stdout.str()


def test_a_warning_passes_with_its_sentence_and_fails_under_strict(pytester):
    spec = f"{ZOO}:NeedWeightsOn"
    truth = next(c for c in tblock_cli.check(spec, d_model=32, n_heads=4, only="need_weights").checks)
    assert truth.status.value == "warn"
    options = ("--tblock", spec, "--tblock-d-model", "32", "--tblock-n-heads", "4", "--tblock-only", "need_weights")
    result = run(pytester, *options)
    result.assert_outcomes(passed=1, warnings=1)
    assert f"TBlockWarning: need_weights: {truth.detail}" in result.stdout.str()
    run(pytester, *options, "--tblock-strict").assert_outcomes(failed=1)


def test_a_block_that_cannot_be_built_fails_each_item_with_the_reason(pytester):
    pytester.makepyfile(test_bad="""
        from tblock_cli.pytest_plugin import check_items
        test_bad = check_items(None, d_model=30, n_heads=4, only="shape,finite")
    """)
    result = run(pytester)
    result.assert_outcomes(errors=2)
    assert result.stdout.str().count("--d-model 30 is not divisible by --n-heads 4") >= 2
