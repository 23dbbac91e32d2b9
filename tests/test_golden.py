"""Golden outputs: every view rendered from fixed reports at a fixed width, compared line by line.

An inverted ratio, ms printed as s, or a dropped column changes the text and fails here. After an
intended change of a view: `pytest tests/test_golden.py --update-golden`, then read the diff. Each
golden also asserts an invariant read back from the text (torchinfo's habit), so a golden rewritten
with a wrong number still fails: params rows add up to the total, check counts to the checks, an
on/off ratio to its medians, depth's gradient finding to its table.
"""

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

import tblock_cli
from tblock_cli import render
from tblock_cli.benchmark.report import BenchReport, BenchResult, Breakdown, Comparison
from tblock_cli.benchmark.timing import Latency
from tblock_cli.checks import CheckReport, CheckResult
from tblock_cli.depth_report import DepthReport, LayerStats, depth_findings
from tblock_cli.report import RunInfo, Status

GOLDEN = Path(__file__).parent / "golden"
ENV = {"torch": "2.13.0", "device": "cpu", "dtype": "float32", "threads": 1}


def rendered(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


def check_report():
    checks = (
        CheckResult("shape", Status.PASS, [2, 10, 64], "shape.kept"),
        CheckResult("residual", Status.PASS, 0.9987, "residual.present", {"gains": [0.9987]}),
        CheckResult("order", Status.WARN, 0.2281, "order.scrambled", {"diff": 0.2281}),
        CheckResult("padding", Status.FAIL, 0.344, "padding.differs_alone", {"side": "right", "diff": 0.344}),
        CheckResult("kv_cache", Status.SKIP, None, "kv_cache.not_causal"),
    )
    return CheckReport(checks, strict=False, run=RunInfo("zoo.py:Example", {}, ENV))


def bench_report():
    def lat(ms, spread=0.01):
        return Latency(tuple(ms / 1e3 * (1 + spread * k) for k in (-2, -1, 0, 1, 2)))

    results = (
        BenchResult("infer", 512, False, "block", lat(20.0), 50 * 2**20, "profiler memory events", "fastpath bmm+softmax", True, 4_000_000_000, 1024),
        BenchResult("infer", 512, True, "block", lat(22.0), 58 * 2**20, "profiler memory events", "fastpath bmm+softmax", True, 4_000_000_000, 1024),
        BenchResult("train", 512, False, "block", lat(60.0), 100 * 2**20, "profiler memory events", "SDPA flash-cpu", False, 12_000_000_000, 1024),
        BenchResult("train", 512, True, "block", lat(80.0, 0.2), 180 * 2**20, "profiler memory events", "bmm+softmax", True, 12_000_000_000, 1024),
        BenchResult("decode", 16, None, "block", lat(1.0), -1, "not measured for decode", "-", False, None, 2, True, 65536, (0.001,) * 4 + (0.0011,) * 4),
        BenchResult("decode", 16, None, "block", lat(5.0), -1, "not measured for decode", "-", False, None, 2, False, None, (0.004,) * 4 + (0.006,) * 4),
    )
    parts = (("attention projections", 0.024, 4 * 2**20, 4), ("attention kernel", 0.017, 2 * 2**20, 1), ("FFN", 0.051, 8 * 2**20, 3),
             ("norms", 0.0006, 2 * 2**20, 2), ("residual adds", 0.0005, 2 * 2**20, 2), ("other", 0.0001, 0, 3))
    breakdown = Breakdown(512, parts, lat(92.4), "eval forward, no_grad, MHA fast path off; each call synchronised and timed")
    comparisons = (Comparison(("infer", 512, False, "block", None), "infer seq 512 need_weights=off", 1.02, False, False, 0, False),
                   Comparison(("train", 512, True, "block", None), "train seq 512 need_weights=on", 1.5, True, False, 4096, True),
                   Comparison(("train", 512, False, "block", None), "train seq 512 need_weights=off", 1.3, False, False, 0, False,
                              ("the saved run",)))
    sizes = {512: {"weights_returned": 2 * 512 * 512 * 4, "matrix_per_head": 2 * 8 * 512 * 512 * 4}}
    return BenchReport("built-in pre-LN block", results, sizes, 2, 8, 0.0, ENV, False, None, (breakdown,), comparisons, 65536, 9.5, 12.0)


def depth_report():
    layers = tuple(LayerStats(i, p, 1.0 + 0.1 * i, 2.0 - 0.2 * i, 0.5, 0.98, 0.01, 0.3) for i, p in enumerate(("pre", "pre", "post")))
    return DepthReport("built-in mixed-LN stack x3", "mixed", layers, False, None, 1.0,
                       tuple(depth_findings(list(layers), False, None, 1.0)), True)


def params_sections(text: str) -> list[list[tuple[str, int]]]:
    """The params table's numbered rows, (label, params), in sections as the table draws them."""
    body = text.split("━", 1)[1].split("\n", 1)[1].split("\nFFN ")[0].split("\nno ")[0]
    sections: list[list[tuple[str, int]]] = [[]]
    for line in body.splitlines():
        if not line.strip():
            sections.append([])
            continue
        m = re.match(r"^\s*(\S.*?)\s+(\d[\d,]*)\s+(\d+\.\d%|100%)\s", line + " ")
        if m:
            sections[-1].append((m.group(1).split()[0], int(m.group(2).replace(",", ""))))
    return [sec for sec in sections if sec]


def rows_sum_to_the_total(text: str, report) -> None:
    """torchinfo's invariant: the component rows (x layers, + the final norm) and the group rows each add up to the total."""
    *parts, groups, (total,) = params_sections(text)
    assert total[0] == "total" and total[1] == report.total
    assert sum(n for _, n in groups) == total[1]
    rows = sum(n for _, n in parts[0])
    if report.layers > 1:
        layer, final = dict(parts[1])["one"], dict(parts[1]).get("final_ln", 0)
        assert rows == layer and layer * report.layers + final == total[1]
    else:
        assert rows == total[1]


def counts_sum_to_the_checks(text: str, report) -> None:
    statuses = re.findall(r"^\s+\w+\s+(pass|warn|fail|skip|error)\b", text, re.M)
    verdict = re.search(r"\n(?:OK|FAILED) +(.*)", text, re.S).group(1)
    tail = dict((s, int(n)) for n, s in re.findall(r"(\d+) (pass|warn|fail|skip|error)\b", verdict))
    assert len(statuses) == len(report.checks) == sum(tail.values())
    assert tail == {s: statuses.count(s) for s in set(statuses)}


def on_off_is_the_ratio_of_the_medians(text: str, report) -> None:
    """Every on/off row: the ratio of the on and off medians printed above it, and the peak difference."""
    checked = 0
    for block in text.split("tblock bench:")[1:]:
        off = re.search(r"^\s+\d+\s+off\s+([\d,.]+) \(.*?([\d,.]+)\s+\S+", block, re.M)
        on = re.search(r"^\s+\d+\s+on\s+([\d,.]+) \(", block, re.M)
        ratio = re.search(r"on/off\s+([\d.]+)x", block)
        if off and on and ratio:
            assert float(ratio.group(1)) == round(float(on.group(1)) / float(off.group(1)), 2)
            checked += 1
    assert checked == sum(1 for m in ("infer", "train") for s in {r.seq for r in report.results} if report.pair(m, s))


def gradient_finding_matches_the_table(text: str, report) -> None:
    grads = [float(g) for g in re.findall(r"^\s+\d+\s+(?:pre|post)\s*<?\s+[\d.]+\s+([\d.]+)", text, re.M)]
    assert len(grads) == len(report.layers)
    m = re.search(r"by x([\d.]+) from the last layer \(([\d.]+)\) to the first \(([\d.]+)\)", " ".join(text.split()))
    assert float(m.group(2)) == grads[-1] and float(m.group(3)) == grads[0]
    assert float(m.group(1)) == float(f"{grads[0] / grads[-1]:.3g}")


INVARIANTS = {
    "check": (check_report, counts_sum_to_the_checks),
    "params": (lambda: tblock_cli.params(d_model=64, n_heads=4, layers=2, seq=16), rows_sum_to_the_total),
    "params_user": (lambda: tblock_cli.params("torch.nn:TransformerEncoderLayer", d_model=32, n_heads=4, kwargs={"dropout": 0.0}),
                    rows_sum_to_the_total),
    "bench": (bench_report, on_off_is_the_ratio_of_the_medians),
    "depth": (depth_report, gradient_finding_matches_the_table),
}

VIEWS = {
    "check": lambda: render.check_view(check_report()),
    "params": lambda: render.params_view(tblock_cli.params(d_model=64, n_heads=4, layers=2, seq=16)),
    "params_user": lambda: render.params_view(tblock_cli.params("torch.nn:TransformerEncoderLayer", d_model=32, n_heads=4,
                                                                kwargs={"dropout": 0.0})),
    "bench": lambda: render.bench_view(bench_report()),
    "depth": lambda: render.depth_view(depth_report()),
}


@pytest.mark.parametrize("width", [100, 60])
@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_matches_golden(name, width, request):
    text = rendered(VIEWS[name](), width)
    path = GOLDEN / f"{name}_{width}.out"
    if request.config.getoption("--update-golden"):
        path.write_text(text)
    assert path.exists(), f"{path.name} is missing: write it with pytest {__file__} --update-golden and read it"
    assert text == path.read_text()
    make, invariant = INVARIANTS[name]
    invariant(text, make())


@pytest.mark.parametrize("name", ["params", "bench", "depth"])
def test_narrow_terminal_never_truncates_a_number(name):
    text = rendered(VIEWS[name](), 60)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 60
    if name == "depth":
        for number in ("1.200", "1.6", "0.980", "post"):
            assert number in text, number
    elif name == "params":
        assert f"{tblock_cli.params(d_model=64, n_heads=4, layers=2, seq=16).total:,}" in text
    else:
        for number in ("20.00 (0.40)", "51,200", "200.0", "180.0", "+80.0", "1.33x"):
            assert number in text, number
        assert "kernel" in text and "bmm+softmax" in text  # the kernel column is kept


def test_bench_view_says_which_is_faster_the_right_way_round():
    text = rendered(render.bench_view(bench_report()), 400)
    assert "cached is 5.00x faster than recomputed" in text  # 1 ms against 5 ms per token
    assert "train, seq 512: need_weights=False runs SDPA flash-cpu instead of bmm+softmax and saves 80.0 MiB" in text
    assert "off is 1.33x faster than on" in text  # train: 60 ms off against 80 ms on, IQRs apart
