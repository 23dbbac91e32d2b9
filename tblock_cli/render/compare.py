"""The `compare` view: what was compared and how close, the findings, and the error per component."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.messages.compare import component
from tblock_cli.render.common import PlainTable

STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "info": "", "skip": "dim", "error": "bold magenta"}
# What each comparison is, in a few words.
WHAT = {"outputs": "outputs (eval)", "padded": "outputs with a padding mask (real tokens)", "input_grad": "input gradient (train)",
        "param_grads": "parameter gradients (train, worst)", "decode": "decoding through both caches",
        "compiled outputs": "outputs (eval)", "compiled input_grad": "input gradient (train)",
        "compiled param_grads": "parameter gradients (train, worst)"}


def num(v) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return "0" if v == 0 else f"{v:.2e}"


def compare_view(report) -> Group:
    table = PlainTable(title=f"tblock compare: {report.run.subject if report.run else report.a + ' vs ' + report.b}",
                  box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("compared", overflow="fold", ratio=1)
    table.add_column("relative", justify="right", no_wrap=True, min_width=8)
    table.add_column("max |A-B|", justify="right", no_wrap=True, min_width=9)
    table.add_column("tolerance", justify="right", no_wrap=True, min_width=9)
    table.add_column("", no_wrap=True, min_width=7)
    for c in report.comparisons:
        what = WHAT.get(c.name, c.name) + (f" at {c.worst}" if c.worst and not c.equal else "")
        table.add_row(what, num(c.rel), num(c.max_abs), num(c.tol), Text("equal" if c.equal else "DIFFERS",
                                                                         style="green" if c.equal else "bold red"))
    parts: list = [table]
    for f in report.findings:
        status = f.status.value
        mark = {"warn": "!", "fail": "x", "pass": "+"}.get(status, "-")
        parts.append(Text(f"{mark} {f.text}", style=STYLE.get(status, "")))
    if report.components:
        parts.append(components_table(report))
    if report.run:
        env = report.run.environment
        where = f"torch {env['torch']}, {env['device']}, {env['dtype']}" + \
            (f" against {report.run.config['dtype_b']}" if report.run.config.get("dtype_b") not in (None, env["dtype"]) else "")
        parts.append(Text.assemble(Text("EQUAL" if report.ok else "DIFFERENT", style="bold green" if report.ok else "bold red"),
                                   f"  [{where}]"))
    return Group(*parts)


def components_table(report) -> Table:
    table = PlainTable(title="error per component (A's role outputs against B's)", box=box.SIMPLE, title_justify="left")
    table.add_column("component", no_wrap=True, min_width=13)
    table.add_column("relative", justify="right", no_wrap=True, min_width=8)
    table.add_column("max |A-B|", justify="right", no_wrap=True, min_width=9)
    table.add_column("what it is", overflow="fold", ratio=1)
    first = report.first_difference
    for d in report.components:
        is_first = first is not None and first.facts.get("component") == d.component
        table.add_row(d.component, num(d.rel), num(d.max_abs), component(d.component) + (" <- first difference" if is_first else ""),
                      style="bold red" if is_first else None)
    return table
