"""Rich renderables and JSON built from the reports; nothing here computes a measurement."""

from __future__ import annotations

import dataclasses
import enum
import json
import math

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "error": "bold magenta"}


def jsonable(obj):
    """Dataclasses, enums, tuples and non-finite floats turned into plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf" / "nan": JSON has no such numbers
    return obj


def dumps(obj) -> str:
    return json.dumps(jsonable(obj), indent=2)


def fmt_value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        if not math.isfinite(v):
            return str(v)
        return f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"
    if isinstance(v, list):
        return "(" + ", ".join(map(str, v)) + ")"
    return str(v)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:,.0f} {unit}" if unit == "B" else f"{sign}{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_count(n: float) -> str:
    """1234567 -> 1.23M; exact integers below 10,000 as they are."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div and abs(n) >= 1e4:
            return f"{n / div:.3g}{unit}" if n / div < 1000 else f"{n / div:,.0f}{unit}"
    return f"{n:,.0f}"


def status_text(status) -> Text:
    value = getattr(status, "value", status)
    return Text(value, style=STATUS_STYLE.get(value, ""))


def check_view(report, subject_name: str, env: dict) -> Group:
    table = Table(title=f"tblock check: {subject_name}", box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("what it means", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, status_text(c.status), fmt_value(c.value), c.detail)
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    verdict = Text("OK" if report.ok else "FAILED", style="bold green" if report.ok else "bold red")
    where = f"torch {env['torch']}, {env['device']}, {env['dtype']}, {env['threads']} threads"
    tail = Text.assemble(verdict, f"  {counts}" + ("  (--strict: warnings fail)" if report.strict else "") + f"  [{where}]")
    return Group(table, tail)


GROUP_STYLE = {"attention": "cyan", "ffn": "magenta", "norm": "green", "other": "yellow", "mixed": "yellow"}


def params_view(report) -> Group:
    stack = report.layers > 1
    title = f"tblock params: {report.subject}, {report.dtype}" + (f" (rows: one layer of {report.layers})" if stack else "")
    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", show_footer=False)
    table.add_column("component", no_wrap=True)
    table.add_column("group", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("share", justify="right")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("FLOPs/token", justify="right", no_wrap=True)
    per_layer_rows = [c for c in report.components if c.name != "final_ln"]
    for c in per_layer_rows:
        flops = fmt_count(c.flops_per_token) + (" *" if c.grows_with_seq else "")
        share = c.params * report.layers / report.total if report.total else 0
        table.add_row(c.name, Text(c.group, style=GROUP_STYLE.get(c.group, "")), f"{c.params:,}", f"{share:.1%}", fmt_bytes(c.bytes), flops)
    table.add_section()
    if stack:
        layer_params = sum(c.params for c in per_layer_rows)
        table.add_row("one layer", "", f"{layer_params:,}", f"{layer_params / report.total:.1%}", fmt_bytes(sum(c.bytes for c in per_layer_rows)),
                      fmt_count(sum(c.flops_per_token for c in per_layer_rows)))
        for c in report.components:
            if c.name == "final_ln":
                table.add_row(c.name, Text(c.group, style=GROUP_STYLE["norm"]), f"{c.params:,}", f"{c.params / report.total:.1%}", fmt_bytes(c.bytes), "0")
        table.add_section()
    for g, n in report.groups.items():
        if n:
            table.add_row(Text(g, style=GROUP_STYLE.get(g, "")), "all layers" if stack else "subtotal", f"{n:,}", f"{n / report.total:.1%}",
                          fmt_bytes(n * report.total_bytes / report.total), "")
    table.add_section()
    table.add_row(Text("total", style="bold"), "", Text(f"{report.total:,}", style="bold"), "100%", fmt_bytes(report.total_bytes), "")
    f = report.flops
    lines = [
        Text(report.ffn_note, style="bold" if report.ffn_share is not None else "dim"),
        Text(f"FLOPs at batch {report.batch} x seq {report.seq} ({report.flops_source}; a multiply-add = 2; matmuls only, "
             f"norms, softmax and activations add O(d) per token): forward {fmt_count(f['forward'])}, "
             f"training step (forward + backward) {fmt_count(f['train_step'])}"),
    ]
    if f.get("forward_seq_quadratic"):
        lines.append(Text(f"* grows with seq^2 over the run: attn.scores and attn.mix, {fmt_count(f['forward_seq_quadratic'])} "
                          f"of the forward ({f['forward_seq_quadratic'] / f['forward']:.1%} at seq {report.seq})"))
    return Group(table, *lines)


def presets_view(presets: dict) -> Table:
    table = Table(title="presets (sources in tblock_cli/config.py)", box=box.SIMPLE_HEAVY, title_justify="left")
    keys = ("d_model", "n_heads", "d_ff", "layers", "norm", "activation", "eps", "causal")
    table.add_column("name", no_wrap=True)
    for k, header in zip(keys, ("d_model", "heads", "d_ff", "layers", "norm", "act", "eps", "causal")):
        table.add_column(header, justify="left" if k in ("norm", "activation", "causal") else "right", no_wrap=True)
    for name, p in presets.items():
        table.add_row(name, *(str(p.get(k, False if k == "causal" else "")) for k in keys))
    return table
