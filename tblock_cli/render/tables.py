"""The check, params and presets views: Rich tables built from the reports, which hold every number."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.messages.units import fmt_bytes
from tblock_cli.render.common import ByWidth, PlainTable, environment_line, fmt_count, fmt_value, status_text, table_for

# Below this many columns the check table keeps two columns, name and status, and puts the value and
# its meaning under the name. Measured on the golden report: the four-column table drops every column
# but the names under 26 columns, and cuts values with an ellipsis at 40-42; from 44 on it is whole.
CHECK_NARROW = 48
GROUP_STYLE = {"attention": "cyan", "ffn": "magenta", "norm": "green", "other": "yellow", "mixed": "yellow"}


def check_view(report) -> Group:
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    verdict = Text("OK" if report.ok else "FAILED", style="bold green" if report.ok else "bold red")
    tail = Text.assemble(verdict, f"  {counts}" + ("  (--strict: warnings fail)" if report.strict else "")
                         + f"  [{environment_line(report.run.environment)}]")
    return Group(ByWidth(lambda fit: check_table(report, fit.narrow), CHECK_NARROW), tail)


def check_table(report, narrow: bool) -> Table:
    title = f"tblock check: {report.run.subject}"
    if narrow:
        table = table_for(True, title=title)
        table.add_column("check", overflow="fold", ratio=1)
        table.add_column("status", no_wrap=True, min_width=5)
        for c in report.checks:
            table.add_row(Text.assemble(c.name, "\n", (f"{fmt_value(c.value)}: {c.detail}", "dim")), status_text(c.status))
        return table
    table = PlainTable(title=title, box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("check", no_wrap=True, min_width=15)
    table.add_column("status", no_wrap=True, min_width=6)
    table.add_column("value", justify="right", no_wrap=True, min_width=9)
    table.add_column("what it means", overflow="fold", ratio=1)
    for c in report.checks:
        table.add_row(c.name, status_text(c.status), fmt_value(c.value), Text(c.detail))
    return table


def params_view(report) -> Group:
    return Group(ByWidth(lambda fit: params_table(report, fit.narrow)), *params_lines(report))


def params_table(report, narrow: bool) -> Table:
    stack = report.layers > 1
    title = f"tblock params: {report.subject}, {report.dtype}" + (f" (rows: one layer of {report.layers})" if stack else "")
    table = table_for(narrow, title=title)
    table.add_column("component" + (" (role, out shape)" if narrow else ""), overflow="fold", ratio=1, min_width=10)
    if not narrow:
        table.add_column("role", overflow="fold", min_width=6)
    table.add_column("params", justify="right", no_wrap=True, min_width=len(f"{report.total:,}"))
    table.add_column("share", justify="right", no_wrap=True, min_width=6)
    table.add_column("bytes", justify="right", no_wrap=True, min_width=9)
    table.add_column("FLOPs/tok", justify="right", no_wrap=True, min_width=9)
    if not narrow:
        table.add_column("out shape", overflow="fold", min_width=9)

    def row(name, role, params: int, share: float | None, nbytes: int, flops: str, shape: str = "", group: str = ""):
        cells = (f"{params:,}", "100%" if share is None else f"{share:.1%}", fmt_bytes(nbytes), flops)
        if narrow:
            first = Text(name) if not (role or shape) else Text.assemble(name, "\n", (" ".join(x for x in (role, shape) if x), "dim"))
            table.add_row(first, *cells)
        else:
            table.add_row(name, Text(role, style=GROUP_STYLE.get(group, "")), *cells, shape)

    for c in (c for c in report.components if c.name != "final_ln" or not stack):
        flops = fmt_count(c.flops_per_token) + (" *" if c.grows_with_seq else "")
        shape = "(" + ", ".join(map(str, c.out_shape)) + ")" if c.out_shape else ""
        row(c.name, c.role or c.group, c.params, report.row_share(c), c.bytes, flops, shape, c.group)
    table.add_section()
    if stack:
        layer = report.one_layer
        row(layer.name, "", layer.params, report.share(layer.params), layer.bytes, fmt_count(layer.flops_per_token))
        for c in report.components:
            if c.name == "final_ln":
                row(c.name, "norm", c.params, report.share(c.params), c.bytes, "0", group="norm")
        table.add_section()
    for g, n in report.groups.items():
        if n:
            row(g, "all layers" if stack else "subtotal", n, report.share(n), report.group_bytes(g), "", group=g)
    table.add_section()
    row("total", "", report.total, None, report.total_bytes, "")
    return table


def params_lines(report) -> list:
    f = report.flops
    lines = []
    for finding in report.findings:
        if finding.status.value == "warn":
            lines.append(Text(f"warning: {finding.text}", style="yellow"))
        else:
            lines.append(Text(finding.text, style="bold" if report.ffn_share is not None else "dim"))
    lines.append(Text(f"FLOPs at batch {report.batch} x seq {report.seq} ({report.flops_source}; a multiply-add = 2; matmuls only, "
                      f"norms, softmax and activations add O(d) per token): forward {fmt_count(f['forward'])}, "
                      f"training step (forward + backward) {fmt_count(f['train_step'])}"))
    if report.quadratic_share is not None:
        lines.append(Text(f"* grows with seq^2: attention scores and mix, {fmt_count(f['forward_seq_quadratic'])} "
                          f"of the forward ({report.quadratic_share:.1%} at seq {report.seq})"))
    kv = report.kv_cache
    if kv:
        lines.append(Text(f"KV cache for decoding: {fmt_bytes(kv['bytes_per_token'])} per token per sequence "
                          f"({kv['bytes_per_token']:,} bytes); {fmt_bytes(kv['bytes_at_seq'])} at batch {kv['batch']} x seq {kv['seq']}, "
                          f"beside {fmt_bytes(report.total_bytes)} of parameters"))
    return lines


def presets_view(presets: dict) -> Table:
    table = PlainTable(title="presets (sources in tblock_cli/config.py)", box=box.SIMPLE_HEAVY, title_justify="left")
    keys = ("d_model", "n_heads", "d_ff", "layers", "norm", "activation", "eps", "causal")
    table.add_column("name", no_wrap=True)
    for k, header in zip(keys, ("d_model", "heads", "d_ff", "layers", "norm", "act", "eps", "causal")):
        table.add_column(header, justify="left" if k in ("norm", "activation", "causal") else "right", no_wrap=True)
    for name, p in presets.items():
        table.add_row(name, *(str(p.get(k, False if k == "causal" else "")) for k in keys))
    return table
