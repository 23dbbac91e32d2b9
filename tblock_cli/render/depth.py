"""The depth views: one stack layer by layer, or pre, post and mixed stacks side by side."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.render.common import ByWidth, PlainTable, finding_line, table_for


def depth_view(report) -> Group:
    lines = [ByWidth(lambda fit: depth_table(report, 8 if fit.narrow else 16, fit))]
    for f in report.findings:
        lines.append(finding_line(f))
    if not report.ok:
        lines.append(Text("FAILED (--strict: warnings fail)", style="bold red"))
    return Group(*lines)


def depth_table(report, width: int, fit) -> Table:
    table = table_for(fit.narrow, title=f"tblock depth: {report.subject} (forward + backward at init, dropout off)")
    for col, just in (("layer", "right"), ("norm", "left"), ("act RMS", "right"), ("grad in", "right"), ("grad par", "right"),
                      ("gain", "right"), ("grad in", "left")):
        table.add_column(col, justify=just, no_wrap=True, min_width=len(col) if col != "norm" else 6)
    top = max(s.grad_input_norm for s in report.layers) or 1.0
    prev = None
    for s in report.layers:
        changed = prev is not None and s.placement != prev
        placement = Text(s.placement + (" <" if changed else ""), style="yellow" if changed else "")
        bar = fit.bar(max(1, round(width * s.grad_input_norm / top)))
        table.add_row(str(s.index), placement, f"{s.act_rms:.3f}", f"{s.grad_input_norm:.4g}", f"{s.grad_param_norm:.4g}",
                      f"{s.residual_gain:.3f}", Text(bar, style="cyan"))
        prev = s.placement
    if report.final_norm:
        table.add_section()
        table.add_row("final", "LayerNorm", f"{report.final_rms:.3f}", "", "", "", "")
    return table


def depth_compare_view(reports: list) -> Group:
    n = len(reports[0].layers)
    table = PlainTable(title=f"tblock depth --compare: {n} layers at init (act RMS / grad-in norm per layer)", box=box.SIMPLE_HEAVY,
                  title_justify="left", pad_edge=False)
    table.add_column("layer", justify="right")
    for r in reports:
        table.add_column(f"{r.norm} act", justify="right", no_wrap=True)
        table.add_column(f"{r.norm} grad", justify="right", no_wrap=True)
    for i in range(n):
        cells = []
        for r in reports:
            s = r.layers[i]
            cells += [f"{s.act_rms:.3f}" + ("*" if s.placement == "post" else " "), f"{s.grad_input_norm:.4g}"]
        table.add_row(str(i), *cells)
    table.add_section()
    table.add_row("final", *[c for r in reports for c in ((f"{r.final_rms:.3f} " if r.final_norm else "-"), "")])
    lines = [table, Text("* the layer's output is normalised (detected Post-LN)", style="dim"),
             ByWidth(lambda fit: Group(*(Text(f"{r.norm:>6}: act {fit.sparkline([s.act_rms for s in r.layers])}  "
                                              f"grad {fit.sparkline([s.grad_input_norm for s in r.layers])}") for r in reports)))]
    for r in reports:
        lines.append(Text(f"{r.norm}:", style="bold"))
        for f in r.findings:
            lines.append(finding_line(f, "  "))
    return Group(*lines)
