"""check --junit-xml: the report as JUnit XML, read back with a JUnit parser."""

import json

import pytest
from typer.testing import CliRunner

from tblock_cli.cli import app

from conftest import zoo_spec

junitparser = pytest.importorskip("junitparser")
runner = CliRunner()
SMALL = ["--d-model", "32", "--n-heads", "4", "--threads", "1"]


def outcome_of(case) -> str:
    kinds = {type(r).__name__ for r in case.result}
    return "failure" if "Failure" in kinds else "error" if "Error" in kinds else "skipped" if "Skipped" in kinds else "passed"


# NoResidual fails `residual`; Unscaled warns, a failure under --strict.
@pytest.mark.parametrize("block, strict", [("NoResidual", False), ("Unscaled", True)])
def test_junit_xml_has_one_case_per_check_and_the_reports_counts(tmp_path, block, strict):
    path = tmp_path / "tblock.xml"
    r = runner.invoke(app, ["check", *SMALL, "--block", zoo_spec(block), "--json", "--junit-xml", str(path),
                            *(["--strict"] if strict else [])])
    assert r.exit_code == 1, r.output
    counts = json.loads(r.stdout)["counts"]
    checks = json.loads(r.stdout)["checks"]
    xml = junitparser.JUnitXml.fromfile(str(path))
    suite = next(iter(xml))
    cases = list(suite)
    assert [c.name for c in cases] == [c["name"] for c in checks]
    assert suite.tests == len(checks)
    assert suite.failures == counts["fail"] + (counts["warn"] if strict else 0)
    assert suite.errors == counts["error"] and suite.skipped == counts["skip"]
    assert suite.failures >= 1 and (counts["warn"] >= 1 if strict else counts["fail"] >= 1)
    by_name = {c.name: outcome_of(c) for c in cases}
    for c in checks:
        expected = {"fail": "failure", "error": "error", "skip": "skipped", "pass": "passed",
                    "warn": "failure" if strict else "passed"}[c["status"]]
        assert by_name[c["name"]] == expected, c["name"]


def test_a_warning_is_a_property_of_its_case_without_strict(tmp_path):
    path = tmp_path / "w.xml"
    r = runner.invoke(app, ["check", *SMALL, "--block", zoo_spec("Unscaled"), "--junit-xml", str(path)])
    assert r.exit_code == 0, r.output
    text = path.read_text()
    assert 'name="warning"' in text and "<failure" not in text


def test_an_unwritable_junit_path_is_refused_before_measuring(tmp_path):
    for target in ("/proc/x.xml", str(tmp_path)):
        r = runner.invoke(app, ["check", *SMALL, "--junit-xml", target])
        assert r.exit_code == 2 and "--junit-xml" in r.stderr and r.stdout == ""
