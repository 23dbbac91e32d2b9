"""Findings are data on every report: status, kind, facts; the words come from messages; assert_ok reads them."""

import json

import pytest
import torch
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError
from tblock_cli.messages import MESSAGES
from tblock_cli.report import Finding, Status

from conftest import zoo_spec

runner = CliRunner()
SMALL = {"d_model": 32, "n_heads": 4, "threads": 1}
BLOCKS = "tests/bench_blocks.py"


def reports():
    """One report of each type, small."""
    return {
        "check": tblock_cli.check(**SMALL),
        "params": tblock_cli.params(**SMALL, layers=2),
        "params_user": tblock_cli.params(zoo_spec("HandSoftmax"), **SMALL),
        "bench": tblock_cli.bench(**SMALL, seq=8, need_weights=True, min_time=0.01),
        "depth": tblock_cli.depth(**SMALL, layers=2, seq=4),
        "depth_compare": tblock_cli.depth(**SMALL, layers=2, seq=4, compare=True),
    }


@pytest.fixture(scope="module")
def every_report():
    torch.set_num_threads(1)
    return reports()


def test_every_report_has_findings_with_kind_facts_and_words(every_report):
    for name, report in every_report.items():
        assert isinstance(report.findings, tuple) and report.findings, name
        for f in report.findings:
            assert isinstance(f.status, Status) and f.kind and isinstance(f.facts, dict), (name, f)
            assert f.kind in MESSAGES, f"{name}: {f.kind} has no sentence in messages/"
            assert f.text and f.text != f.kind
        json.dumps(report.to_dict())  # facts are JSON-ready


def test_json_findings_carry_status_text_kind_facts(every_report):
    for name in ("params", "bench", "depth"):
        data = every_report[name].to_dict()
        assert data["findings"] and all(list(f) == ["status", "text", "kind", "facts"] for f in data["findings"]), name
    for body in every_report["depth_compare"].to_dict()["compare"]:
        assert all({"kind", "facts"} <= set(f) for f in body["findings"])


def test_findings_hold_numbers_and_render_only_formats(every_report):
    p = every_report["params"]
    (share,) = [f for f in p.findings if f.kind == "params.ffn_share"]
    assert share.facts["share"] == pytest.approx(p.groups["ffn"] / p.total) == pytest.approx(p.ffn_share)
    assert share.text == p.ffn_note and f"{p.ffn_share:.1%}" in share.text
    assert sum(p.row_share(c) for c in p.components) == pytest.approx(1.0)
    d = every_report["depth"]
    (grad,) = [f for f in d.findings if f.kind == "depth.gradient"]
    assert grad.facts["ratio"] == pytest.approx(d.layers[0].grad_input_norm / d.layers[-1].grad_input_norm)
    b = every_report["bench"]
    ratio, more = b.on_off("infer", 8)
    off, on = b.pair("infer", 8)
    assert ratio == pytest.approx(on.latency.median / off.latency.median) and more == on.peak_bytes - off.peak_bytes
    (nw,) = [f for f in b.findings if f.kind == "bench.need_weights" and f.facts["mode"] == "infer"]
    assert nw.facts["latency"]["ratio"] == pytest.approx(ratio)


def test_linear_chains_are_pairs_and_a_warning_finding():
    r = tblock_cli.params(zoo_spec("LinearFFN"), **SMALL)
    chains = [f for f in r.findings if f.kind == "params.linear_chain"]
    assert chains and chains[0].status is Status.WARN and len(r.linear_chains[0]) == 2
    assert (chains[0].facts["first"], chains[0].facts["second"]) == r.linear_chains[0]
    assert r.to_dict()["linear_chains"] == [f"{a} -> {b}" for a, b in r.linear_chains]
    assert r.ok  # params counts; a warning does not fail it


def test_an_unknown_kind_still_shows_its_facts():
    assert Finding(Status.INFO, "nope.none", {"x": 1}).text == "nope.none {'x': 1}"


def test_assert_ok_passes_on_ok_reports(every_report):
    for report in every_report.values():
        tblock_cli.assert_ok(report)


def test_assert_ok_on_a_failing_check_lists_the_check():
    report = tblock_cli.check(zoo_spec("NoResidual"), **SMALL)
    with pytest.raises(AssertionError, match="residual: fail"):
        tblock_cli.assert_ok(report)


def test_assert_ok_on_a_strict_depth_lists_the_warning():
    report = tblock_cli.depth(**SMALL, layers=2, seq=4, norm="mixed", strict=True)
    assert not report.ok
    with pytest.raises(AssertionError, match="depth.mixed_placement: warn: mixed norm placement"):
        tblock_cli.assert_ok(report)
    loose = tblock_cli.depth(**SMALL, layers=2, seq=4, norm="mixed")
    tblock_cli.assert_ok(loose)


def test_assert_ok_on_a_failing_bench_compare_lists_the_regression():
    """Before, a failing bench made assert_ok raise TypeError: 'method' object is not iterable."""
    base = tblock_cli.bench(**SMALL, seq=8, mode="infer", min_time=0.01)
    saved = base.to_dict()
    for r in saved["results"]:
        r["peak_bytes"] //= 2  # the saved run used half the memory: a regression whatever the noise
    report = tblock_cli.bench(**SMALL, seq=8, mode="infer", min_time=0.01, compare_with=saved)
    assert not report.ok and report.to_dict()["ok"] is False
    with pytest.raises(AssertionError, match="bench.regression: fail: regression at infer seq 8"):
        tblock_cli.assert_ok(report)


@pytest.mark.parametrize("thing", [None, 3, "report", {"ok": False}, [1]])
def test_assert_ok_refuses_what_is_not_a_report(thing):
    with pytest.raises(ConfigError, match="assert_ok takes a report"):
        tblock_cli.assert_ok(thing)
    with pytest.raises(TypeError):
        tblock_cli.assert_ok(thing)


def test_bench_a_block_without_parameters_measures_train():
    res = runner.invoke(app, ["bench", "--block", f"{BLOCKS}:NoParams", "--d-model", "32", "--n-heads", "4", "--seq", "8",
                              "--min-time", "0.01", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {r["mode"] for r in data["results"]} == {"infer", "train"}
    assert "bench.train_input_only" in [f["kind"] for f in data["findings"]]


def test_bench_a_block_with_no_gradient_path_skips_train_with_a_finding():
    res = runner.invoke(app, ["bench", "--block", f"{BLOCKS}:Detached", "--d-model", "32", "--n-heads", "4", "--seq", "8",
                              "--min-time", "0.01", "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {r["mode"] for r in data["results"]} == {"infer"}
    (skip,) = [f for f in data["findings"] if f["kind"] == "bench.train_skipped"]
    assert skip["status"] == "warn"


def test_bench_decode_of_the_wrong_shape_is_one_line_exit_one():
    res = runner.invoke(app, ["bench", "--block", f"{BLOCKS}:BadDecode", "--d-model", "32", "--n-heads", "4", "--seq", "8",
                              "--decode", "4", "--min-time", "0.01", "--threads", "1"])
    assert res.exit_code == 1, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and "shape (2, 1, 1)" in res.stderr and "(2, 8, 32)" in res.stderr


def test_one_report_protocol_and_one_finding_type(every_report):
    """ok / failing / findings are written once (report.Verdict); compare's findings are the same Finding type. A
    planted failing finding turns any report not ok, and a warning only under strict."""
    import dataclasses

    from tblock_cli.comparing.report import CompareReport
    from tblock_cli.comparing.report import Finding as CompareFinding
    from tblock_cli.report import Verdict

    assert CompareFinding is Finding and issubclass(CompareReport, Verdict)
    for name, report in every_report.items():
        assert isinstance(report, Verdict), name
    depth = every_report["depth"]
    for status, strict, ok in ((Status.FAIL, False, False), (Status.WARN, False, True), (Status.WARN, True, False)):
        planted = dataclasses.replace(depth, findings=depth.findings + (Finding(status, "depth.no_final_norm", {}),), strict=strict)
        assert planted.ok is ok and (planted.failing[-1:] == planted.findings[-1:]) is (not ok), (status, strict)


def test_a_check_that_raises_is_named_as_the_reason_its_dependants_skip():
    # the gradient path raises: input_unchanged reports the error, and what builds on it says that, not that the
    # forward writes into its input
    by = {c.name: c for c in tblock_cli.check(zoo_spec("FailsWithGrad"), d_model=32, n_heads=4,
                                              threads=1, only="input_unchanged,grad_input,residual").checks}
    assert by["input_unchanged"].status is Status.ERROR
    for name in ("grad_input", "residual"):
        assert by[name].kind == "needs.raised" and by[name].facts["check"] == "input_unchanged", by[name]
        assert "grad path broken" in by[name].detail and "in place" not in by[name].detail


def test_every_outcome_a_check_can_return_has_its_sentence():
    """Read off the source, not off a run: a kind only a rare block reaches (a parameter a forward writes, a
    recompute that writes again) would otherwise show as its bare name and facts."""
    import re
    from pathlib import Path

    call = re.compile(r"\b(?:failed|warned|passed|skipped)\(\s*\"([a-z0-9_]+\.[a-z0-9_]+)\"")
    root = Path(tblock_cli.__file__).parent / "checks"
    kinds = {(m.group(1), p.name) for p in root.glob("*.py") for m in call.finditer(p.read_text())}
    assert len(kinds) > 100  # the pattern still finds the battery's outcomes
    assert not sorted(k for k in kinds if k[0] not in MESSAGES)
