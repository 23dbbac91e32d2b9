"""The spec framework: declarations parsed and refused, the judge's rule, the card's JSON, the CLI's exit codes and
view. The readers' own numbers are tested beside them (test_spec_*.py)."""

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tblock_cli.card.declare import validate
from tblock_cli.card.entries import KEYS, Card, Claim, Entry, judge, parse_expect, parse_value, same
from tblock_cli.card.report import SpecReport
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError
from tblock_cli.report import RunInfo

SMALL = ["--d-model", "32", "--n-heads", "4", "--threads", "1"]


def test_a_numeric_key_takes_none_only_where_it_says_so():
    assert [c.value for c in parse_expect(["attn.softcap=none", "attn.window=none", "attn.group=2"])] == ["none", "none", 2.0]


def test_values_parse_as_the_card_writes_them():
    assert parse_value("500000") == 500000.0
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("none") == "none" and parse_value("GELU_tanh") == "gelu_tanh"
    assert parse_value("0.5, 0.25") == (0.5, 0.25)
    with pytest.raises(ConfigError):
        parse_value("inf")


@pytest.mark.parametrize("items, needle", [(["rope.thta=1"], "rope.theta"), (["rope.theta"], "KEY=VALUE"), ([3], "KEY=VALUE"),
                                           (["attn.group=abc"], "takes a number"), (["ffn.hidden=true"], "takes a number"),
                                           (["rope.theta=none"], "takes a number, got 'none'"),
                                           (["bias.qkv=maybe"], "takes true or false, got 'maybe'"),
                                           (["ffn.gated=2"], "takes true or false")])
def test_a_bad_expect_is_refused_naming_what_to_write(items, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse_expect(items)


@pytest.mark.parametrize("like, kwargs", [("llama", None), ("hf:", None), (None, '{"rope_theta": 1}'), ("hf:llama", "[1]"),
                                          ("hf:llama", "{bad")])
def test_a_bad_like_is_refused(like, kwargs):
    with pytest.raises(ConfigError):
        validate(like, kwargs, None)


def test_same_is_relative_for_numbers_and_exact_for_words():
    assert same(10000.0, 10400.0, 0.05) and not same(10000.0, 10600.0, 0.05)
    assert same(8, 8, 0) and not same(8, 7, 0)
    assert same((1.0, 0.5), (1.01, 0.5), 0.02) and not same((1.0, 0.5), (1.0,), 0.5)
    assert same("gelu_tanh", "GELU_TANH", 0) and not same("gelu", "gelu_tanh", 0)
    assert not same(True, 1, 0) and same(False, False, 0)


def card():
    return Card("blk", (Entry("rope.theta", 10000.0, "angle per position", tol=0.01),
                        Entry("ffn.act", "gelu", "curve fit"),
                        Entry("attn.heads", 4, "heads", judged=False),
                        Entry("attn.softcap", None, skip="no attention")))


def test_judge_says_match_differs_and_unread_and_a_later_claim_wins():
    claims = (Claim("rope.theta", 500000.0, "--like hf:llama", 0.01), Claim("rope.theta", 10050.0, "--expect"),
              Claim("ffn.act", "gelu_tanh", "--expect"), Claim("attn.softcap", 50.0, "--expect"))
    got = {v.key: v for v in judge(card(), claims)}
    assert got["rope.theta"].status == "match" and got["rope.theta"].source == "--expect"  # within 1 %
    assert got["ffn.act"].status == "differs" and got["ffn.act"].measured == "gelu"
    assert got["attn.softcap"].status == "unread" and got["attn.softcap"].why == "no attention"
    assert list(got) == [k for k in KEYS if k in got]  # in the card's order


def report(claims=()):
    return SpecReport(card(), judge(card(), claims), run=RunInfo("blk", {}, {}))


def test_report_is_ok_unless_an_entry_differs_and_json_keeps_each_verdict():
    assert report().ok and report((Claim("attn.softcap", 50.0, "--expect"),)).ok  # unread is no failure
    bad = report((Claim("ffn.act", "relu", "--expect"),))
    assert not bad.ok and [f.kind for f in bad.failing] == ["spec.differs"]
    data = bad.to_dict()
    assert data["command"] == "spec" and data["counts"] == {"match": 0, "differs": 1, "unread": 0}
    assert data["verdicts"][0] == {"key": "ffn.act", "status": "differs", "claimed": "relu", "measured": "gelu",
                                   "source": "--expect"}
    assert "ffn.act: measured gelu, --expect says relu" in bad.failing[0].text


def test_view_shows_values_declarations_and_the_verdict():
    from tblock_cli.render.spec import spec_view

    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(spec_view(report((Claim("ffn.act", "relu", "--expect"), Claim("rope.theta", 1e4, "--expect")))))
    text = console.file.getvalue()
    assert "rope.theta" in text and "1e+04: as declared" in text and "relu: DIFFERS" in text
    assert "DIFFERS: 1 as declared, 1 differ, 0 unread" in text
    assert "not read for this block: attn.softcap" in text


@pytest.mark.parametrize("args", [["--expect", "nosuch=1"], ["--like", "llama"], ["--like-kwargs", "{}"]])
def test_cli_refuses_bad_declarations_in_one_line(args):
    for command in ("spec", "check"):
        res = CliRunner().invoke(app, [command, *SMALL, *args])
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output and res.output.count("\n") <= 2


def test_check_without_a_declaration_skips_spec_and_like_reference():
    import tblock_cli

    rep = tblock_cli.check(d_model=32, n_heads=4, threads=1, only="spec,like_reference")
    assert [(c.name, c.status.value, c.kind) for c in rep.checks] == [("spec", "skip", "spec.undeclared"),
                                                                      ("like_reference", "skip", "like_reference.undeclared")]


def test_spec_json_is_one_object_with_the_card():
    res = CliRunner().invoke(app, ["spec", *SMALL, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [e["key"] for e in data["card"]["entries"]] == list(KEYS)


def test_the_api_function_spec_is_not_shadowed_by_the_package_that_reads_the_card():
    import tblock_cli
    import tblock_cli.card.entries  # noqa: F401 - importing a subpackage sets its name on tblock_cli

    assert callable(tblock_cli.spec) and tblock_cli.spec.__name__ == "spec"


def test_spec_exits_1_naming_an_entry_that_differs_and_0_when_it_holds():
    wrong = CliRunner().invoke(app, ["spec", *SMALL, "--expect", "attn.heads=5", "--expect", "ffn.act=gelu", "--json"])
    assert wrong.exit_code == 1, wrong.output
    data = json.loads(wrong.stdout)
    assert {v["key"]: v["status"] for v in data["verdicts"]} == {"attn.heads": "differs", "ffn.act": "match"}
    right = CliRunner().invoke(app, ["spec", *SMALL, "--expect", "attn.heads=4", "--expect", "norm.kind=layernorm"])
    assert right.exit_code == 0, right.output
    assert "OK: 2 as declared, 0 differ, 0 unread" in right.output
