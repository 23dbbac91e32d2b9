"""Every command's --json carries the envelope and validates against docs/tblock.schema.json."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tblock_cli.cli import app

from conftest import zoo_spec

jsonschema = pytest.importorskip("jsonschema")
SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "tblock.schema.json").read_text())
SMALL = ["--d-model", "32", "--n-heads", "4"]
RUNS = {
    "check": ["check", *SMALL],
    "check-user": ["check", *SMALL, "--block", zoo_spec("CachedLlama"), "--causal"],
    "spec": ["spec", *SMALL, "--expect", "attn.heads=4"],
    "params": ["params", *SMALL, "--layers", "2"],
    "params-user": ["params", *SMALL, "--block", zoo_spec("HandSoftmax")],
    "bench": ["bench", *SMALL, "--seq", "8", "--need-weights", "--min-time", "0.01", "--baseline", "torch"],
    "bench-decode": ["bench", *SMALL, "--seq", "4", "--decode", "4", "--min-time", "0.01", "--breakdown"],
    "depth": ["depth", *SMALL, "--layers", "2", "--seq", "4"],
    "depth-compare": ["depth", *SMALL, "--layers", "2", "--seq", "4", "--compare"],
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_json_validates_against_the_schema(name):
    res = CliRunner().invoke(app, [*RUNS[name], "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    jsonschema.validate(data, SCHEMA)
    assert list(data)[:7] == ["schema_version", "command", "ok", "subject", "config", "environment", "warnings"]


def test_schema_rejects_a_broken_envelope():
    res = CliRunner().invoke(app, [*RUNS["check"], "--json"])
    data = json.loads(res.stdout)
    del data["environment"]["threads"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)
    data = json.loads(res.stdout)
    data["checks"][0]["status"] = "passed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)
