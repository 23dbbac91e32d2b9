"""bench --save / --compare: a saved run is validated before anything is measured; a noisy point gets no verdict."""

import json

import pytest
from typer.testing import CliRunner

from tblock_cli.benchmark.report import BenchReport, BenchResult
from tblock_cli.benchmark.saved import compare, validate_saved
from tblock_cli.benchmark.timing import Latency
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError

runner = CliRunner()
ARGS = ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "8", "--mode", "infer", "--min-time", "0.01", "--threads", "1"]
ENV = {"torch": "2.13.0", "device": "cpu", "dtype": "float32", "threads": 1}


def saved_run(samples=(1.0, 1.01, 0.99, 1.0, 1.0), **result) -> dict:
    """A minimal valid saved run (what bench --save writes, cut to the keys --compare reads)."""
    r = {"mode": "infer", "seq": 8, "need_weights": None, "target": "block", "peak_bytes": 1000,
         "latency_ms": {"samples": list(samples), "number_per_sample": 1}, **result}
    return {"schema_version": 1, "command": "bench", "config": {}, "environment": {"device": "cpu"}, "results": [r]}


def broken(change) -> dict:
    data = saved_run()
    change(data)
    return data


BROKEN = {
    "no samples": broken(lambda d: d["results"][0]["latency_ms"].pop("samples")),
    "no mode": broken(lambda d: d["results"][0].pop("mode")),
    "empty samples": broken(lambda d: d["results"][0]["latency_ms"].update(samples=[])),
    "string sample": broken(lambda d: d["results"][0]["latency_ms"].update(samples=["fast"])),
    "string seq": broken(lambda d: d["results"][0].update(seq="8")),
    "string peak": broken(lambda d: d["results"][0].update(peak_bytes="1 MB")),
    "config a list": broken(lambda d: d.update(config=[1, 2])),
    "no results": broken(lambda d: d.update(results=[])),
    "result a number": broken(lambda d: d.update(results=[3])),
    "latency a number": broken(lambda d: d["results"][0].update(latency_ms=3.0)),
    "zero number_per_sample": broken(lambda d: d["results"][0]["latency_ms"].update(number_per_sample=0)),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_malformed_saved_run_is_refused_before_measuring(name, tmp_path, monkeypatch):
    def measured(*a, **k):
        raise AssertionError("measured before the saved run was validated")

    monkeypatch.setattr("tblock_cli.benchmark.run.run_bench", measured)
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(BROKEN[name]))
    res = runner.invoke(app, [*ARGS, "--compare", str(path)])
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("error: --compare") and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_the_validation_names_what_is_wrong():
    with pytest.raises(ConfigError, match=r"results\[0\]\.latency_ms\.samples"):
        validate_saved(BROKEN["empty samples"])
    with pytest.raises(ConfigError, match="'config' must be an object"):
        validate_saved(BROKEN["config a list"])
    assert validate_saved(saved_run()) == saved_run()


def test_an_empty_compare_path_is_refused():
    res = runner.invoke(app, [*ARGS, "--compare", ""])
    assert res.exit_code == 2 and "--compare needs" in res.stderr


def test_the_api_validates_compare_with_too():
    import tblock_cli

    with pytest.raises(ConfigError, match="compare_with"):
        tblock_cli.bench(seq=8, mode="infer", d_model=32, n_heads=4, compare_with=BROKEN["empty samples"])


def test_save_refuses_to_overwrite_a_file_that_is_not_a_saved_run(tmp_path, monkeypatch):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    monkeypatch.setattr("tblock_cli.benchmark.run.run_bench", lambda *a, **k: pytest.fail("measured"))
    res = runner.invoke(app, [*ARGS, "--save", str(notes)])
    assert res.exit_code == 2 and "not a tblock bench run" in res.stderr
    assert notes.read_text() == "my notes\n"
    other_json = tmp_path / "other.json"
    other_json.write_text('{"command": "check", "schema_version": 1}')
    assert runner.invoke(app, [*ARGS, "--save", str(other_json)]).exit_code == 2


def test_save_replaces_an_earlier_saved_run(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved_run()))
    res = runner.invoke(app, [*ARGS, "--save", str(path)])
    assert res.exit_code == 0, res.output
    assert json.loads(path.read_text())["results"][0]["latency_ms"]["samples"] != saved_run()["results"][0]["latency_ms"]["samples"]


def report_with(samples) -> BenchReport:
    lat = Latency(tuple(s / 1e3 for s in samples))
    return BenchReport("b", (BenchResult("infer", 8, None, "block", lat, 1000, "x", "k", False, None, 16),), {8: {}}, 2, 4, 0.0, ENV)


QUIET = (1.0, 1.01, 0.99, 1.0, 1.0)
NOISY = (1.0, 1.6, 1.3, 2.0, 1.1)  # IQR far above 10 % of the median


@pytest.mark.parametrize("now, then, noisy", [(NOISY, QUIET, ["this run"]), (QUIET, NOISY, ["the saved run"]),
                                              (NOISY, NOISY, ["this run", "the saved run"])])
def test_a_noisy_point_is_inconclusive_not_a_regression(now, then, noisy):
    slow_now = tuple(3 * s for s in now)  # 3x the saved median: a regression, were the samples quiet
    report = report_with(slow_now)
    comparisons = compare(report, saved_run(then))
    assert [c.slower for c in comparisons] == [False] and comparisons[0].noisy == tuple(noisy)
    from dataclasses import replace

    report = replace(report, comparisons=tuple(comparisons))
    assert report.ok
    kinds = [f.kind for f in report.findings]
    assert "bench.inconclusive" in kinds and "bench.regression" not in kinds
    assert report.to_dict()["comparison"][0]["inconclusive"] is True


def test_a_quiet_slower_point_is_a_regression_that_fails():
    from dataclasses import replace

    report = report_with(tuple(3 * s for s in QUIET))
    report = replace(report, comparisons=tuple(compare(report, saved_run(QUIET))))
    assert not report.ok
    (bad,) = report.failing
    assert bad.kind == "bench.regression" and bad.facts["ratio"] == pytest.approx(3.0) and "3.00x the saved latency" in bad.text


def test_a_saved_point_flagged_noisy_is_inconclusive_too():
    report = report_with(tuple(3 * s for s in QUIET))
    saved = saved_run(QUIET)
    saved["results"][0]["latency_ms"]["noisy"] = True  # what that run judged of itself
    (c,) = compare(report, saved)
    assert c.inconclusive and not c.slower and c.noisy == ("the saved run",)


def test_cli_compare_against_a_noisy_saved_run_exits_zero_and_says_inconclusive(tmp_path):
    """Before, a noisy point was called a regression (exit 1, "1.37x slower")."""
    path = tmp_path / "base.json"
    res = runner.invoke(app, [*ARGS, "--save", str(path)])
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    m = data["results"][0]["latency_ms"]["median"]
    # noisy (as that run judged itself), and within CLEAR_FACTOR of this run: the noise could explain the difference
    data["results"][0]["latency_ms"].update(samples=[m / 3, m / 2, m / 3, m / 1.2, m / 2.5], noisy=True)
    path.write_text(json.dumps(data))
    res = runner.invoke(app, [*ARGS, "--compare", str(path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["comparison"][0]["inconclusive"] is True and out["comparison"][0]["slower"] is False
    assert "bench.inconclusive" in [f["kind"] for f in out["findings"]]
