"""--html: one self-contained page per command, read back by a strict parser, with the figures its report holds drawn
from the report's own numbers; the overwrite rule; a real browser renders and prints it (skipped without one)."""

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from tblock_cli.cli import app
from tblock_cli.render import svg
from tblock_cli.render.html import GENERATOR, html_report

runner = CliRunner()
SMALL = ["--d-model", "32", "--n-heads", "4", "--threads", "1"]
# command -> its arguments and the figures its page must hold
PAGES = {
    "check": (["check", *SMALL, "--only", "shape,finite,residual,padding,causal"], 1),  # the status strip
    "params": (["params", *SMALL], 1),  # parameters per component
    "bench": (["bench", *SMALL, "--seq", "8,16", "--min-time", "0.01", "--mode", "infer"], 2),  # latency, memory
    "depth": (["depth", *SMALL, "--layers", "3"], 3),  # activation RMS, gradient norm, residual gain per layer
    "compare": (["compare", "builtin", "builtin", *SMALL, "--dtype-b", "bfloat16"], 1),  # error per component
    "spec": (["spec", *SMALL], 0),  # the built-in block has no rotary or relative bias to draw
}
EXTERNAL = re.compile(r"https?:|src=|<script|<link|@import|url\(|<iframe|<img", re.I)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def strict_parse(page: str) -> ET.Element:
    """The page as XML: every tag closed and every text escaped, or ParseError; nothing loaded from elsewhere."""
    root = ET.fromstring(page)
    assert root.tag == "html"
    assert not EXTERNAL.search(page), EXTERNAL.search(page)
    assert root.find("head/meta[@name='generator']").get("content") == GENERATOR
    for chart in root.iter("svg"):
        assert chart.find("title") is not None and chart.get("viewBox")
    return root


def write_page(tmp_path, command: str) -> tuple[dict, str]:
    args, _ = PAGES[command]
    path = tmp_path / f"{command}.html"
    res = runner.invoke(app, [*args, "--json", "--html", str(path)])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), path.read_text()


@pytest.mark.parametrize("command", list(PAGES))
def test_each_command_writes_one_self_contained_page(command, tmp_path):
    data, page = write_page(tmp_path, command)
    root = strict_parse(page)
    assert len(list(root.iter("svg"))) == PAGES[command][1]
    assert f"tblock {command}: {data['subject']}" in root.find("head/title").text
    for finding in data.get("findings", []):  # the report's sentences, all of them
        assert finding["text"] in "".join(root.itertext())
    if command == "check":  # one row per check, with its status
        rows = {tr[0].text: tr[1].text for tr in root.iter("tr") if len(tr) == 5 and tr[0].text in
                {c["name"] for c in data["checks"]}}
        assert rows == {c["name"]: c["status"] for c in data["checks"]}


def point_titles(root: ET.Element) -> set[str]:
    return {c.find("title").text for c in root.iter("circle")}


def test_the_bench_figures_plot_the_reported_medians_and_peaks(tmp_path):
    data, page = write_page(tmp_path, "bench")
    titles = point_titles(strict_parse(page))
    for r in data["results"]:
        assert f"infer: {svg.fmt(r['seq'])}, {svg.fmt(r['latency_ms']['median'])}" in titles
        assert f"infer: {svg.fmt(r['seq'])}, {svg.fmt(r['peak_bytes'] / 2**20)}" in titles


def test_the_depth_figures_plot_each_layer(tmp_path):
    data, page = write_page(tmp_path, "depth")
    titles = point_titles(strict_parse(page))
    for layer in data["layers"]:
        for key in ("act_rms", "grad_input_norm", "residual_gain"):
            assert f"pre: {layer['index']}, {svg.fmt(layer[key])}" in titles


def test_depth_compare_draws_a_line_per_stack_in_each_figure(tmp_path):
    path = tmp_path / "depth.html"
    assert runner.invoke(app, ["depth", "--compare", *SMALL, "--layers", "2", "--html", str(path)]).exit_code == 0
    charts = list(strict_parse(path.read_text()).iter("svg"))
    assert len(charts) == 3
    for chart in charts:
        assert [t.find("title").text for t in chart.iter("text") if t.get("class") == "legend"] == ["pre", "post", "mixed"]


def test_the_compare_figure_has_a_bar_per_component(tmp_path):
    data, page = write_page(tmp_path, "compare")
    bars = [r.find("title").text for r in strict_parse(page).iter("rect") if r.get("class") == "bar"]
    assert bars == [f"{c['component']}: {svg.fmt(c['rel'])}" for c in data["components"]]


def test_the_rotary_figure_holds_the_card_frequencies_against_theta():
    theta, dims = 10000.0, 8
    freqs = [theta ** (-2 * i / dims) for i in range(dims // 2)]  # what a rotary layer with this theta computes
    card = {"subject": "rope", "entries": [{"key": "rope.theta", "value": theta, "how": "fit"},
                                           {"key": "rope.dims", "value": dims, "how": "count"},
                                           {"key": "rope.freqs", "value": freqs, "how": "probe"}], "slips": []}
    root = strict_parse(html_report({"command": "spec", "ok": True, "subject": "rope", "card": card, "verdicts": []}))
    (chart,) = root.iter("svg")
    assert {f"measured: {i}, {svg.fmt(f)}" for i, f in enumerate(freqs)} <= point_titles(root)
    assert any(line.get("stroke-dasharray") for line in chart.iter("polyline"))  # theta's curve, dashed


def test_a_file_that_is_not_a_report_is_never_overwritten(tmp_path, monkeypatch):
    notes = tmp_path / "notes.html"
    notes.write_text("<p>my notes</p>\n")
    monkeypatch.setattr("tblock_cli.api.check", lambda *a, **k: pytest.fail("measured"))
    res = runner.invoke(app, ["check", *SMALL, "--html", str(notes)])
    assert res.exit_code == 2 and "not a tblock report" in res.stderr
    assert notes.read_text() == "<p>my notes</p>\n"
    assert runner.invoke(app, ["check", *SMALL, "--html", str(tmp_path)]).exit_code == 2  # a folder


def test_a_report_is_replaced_by_the_next_one(tmp_path):
    path = tmp_path / "report.html"
    path.write_text(html_report({"command": "check", "ok": False, "subject": "earlier", "checks": []}))
    res = runner.invoke(app, ["check", *SMALL, "--only", "shape", "--html", str(path)])
    assert res.exit_code == 0 and "saved" in res.stderr
    assert "earlier" not in path.read_text()


@pytest.mark.parametrize("command", [*PAGES, "other"])
def test_a_report_with_only_the_envelope_still_makes_a_page(command):
    strict_parse(html_report({"command": command, "ok": True, "subject": "s", "config": {}, "environment": {}}))


def test_bench_tp_falls_back_to_generic_tables():
    page = html_report({"command": "bench", "ok": True, "subject": "s", "tp": 2, "seq": 16,
                        "ranks": [{"rank": 0, "median_s": 0.5, "samples": [0.5] * 20, "collective_share": 0.1}]})
    text = "".join(strict_parse(page).itertext())
    assert "collective_share" in text and "(20 in all)" in text


def test_ticks_are_round_numbers():
    assert svg.linear_ticks(0, 0.06) == [0, 0.02, 0.04, 0.06]  # steps of 1, 2, 2.5 or 5 times a power of ten
    assert svg.log_ticks(1e-4, 1) == [1e-4, 1e-3, 1e-2, 1e-1, 1]  # decades where there are three or more
    assert svg.log_ticks(0.8, 49) == [1, 2, 5, 10, 20]  # within two decades: 1, 2, 5 of each


def test_text_from_the_block_is_escaped():
    page = html_report({"command": "check", "ok": True, "subject": "<Block & co>", "warnings": ['a "quoted" <tag>'],
                        "checks": [{"name": "shape", "status": "pass", "value": "<b>", "detail": "x < y & z"}]})
    root = strict_parse(page)
    assert "<Block & co>" in root.find("head/title").text
    assert "x < y & z" in "".join(root.itertext())


@pytest.mark.skipif(not any(shutil.which(b) for b in BROWSERS), reason="no Chromium or Chrome installed")
def test_a_headless_browser_renders_and_prints_the_page(tmp_path):
    from PIL import Image

    browser = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    _, page = write_page(tmp_path, "depth")
    url = (tmp_path / "depth.html").as_uri()
    shot, pdf = tmp_path / "depth.png", tmp_path / "depth.pdf"
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}"]
    subprocess.run([*base, "--window-size=1000,900", f"--screenshot={shot}", url], check=True, timeout=120, capture_output=True)
    subprocess.run([*base, "--no-pdf-header-footer", f"--print-to-pdf={pdf}", url], check=True, timeout=120, capture_output=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 900)
    colours = {c for _, c in image.getcolors(maxcolors=image.width * image.height)}
    near = lambda c, target: all(abs(a - b) < 12 for a, b in zip(c, target))  # noqa: E731
    assert any(near(c, (0x1A, 0x7F, 0x37)) for c in colours)  # the green "ok" pill: the inline style was applied
    assert any(near(c, (0x00, 0x72, 0xB2)) for c in colours)  # the first series' blue: the SVG was drawn
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5000
