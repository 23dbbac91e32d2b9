"""The bench view: sweep tables, on/off and torch ratios, decoding, breakdowns, the saved-run comparison, memory bars."""

from __future__ import annotations

import statistics

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.messages.units import fmt_bytes
from tblock_cli.render.common import ByWidth, PlainTable, environment_line, finding_line, table_for


def run_label(r) -> str:
    if r.target == "torch":
        return "torch"
    if r.mode == "decode":
        return "cached" if r.kv_cache else "recompute"
    return {None: "as written", True: "on", False: "off"}[r.need_weights]


def bench_view(report) -> Group:
    parts: list = []
    modes = [m for m in ("infer", "train") if any(r.mode == m for r in report.results)]
    seqs = sorted({r.seq for r in report.results if r.mode != "decode"})
    forced = any(r.need_weights is not None for r in report.results)
    for mode in modes:
        parts.append(ByWidth(lambda fit, mode=mode: sweep_table(report, mode, seqs, forced, fit.narrow)))
    if seqs:
        sizes = "; ".join(f"seq {s}: need_weights=True returns (B, L, L) = {fmt_bytes(v['weights_returned'])}, "
                          f"one (B, H, L, L) matrix = {fmt_bytes(v['matrix_per_head'])}" for s, v in report.attention_bytes.items())
        parts.append(Text(f"Analytic sizes at batch {report.batch}, {report.heads} heads: {sizes}", style="dim"))
    decode = report.decode_pair()
    if decode:
        parts.append(ByWidth(lambda fit: decode_view(report, *decode, fit)))
    for b in report.breakdowns:
        parts.append(ByWidth(lambda fit, b=b: breakdown_view(b, 8 if fit.narrow else 24, fit)))
    if report.comparisons is not None:
        parts.append(comparison_view(report))
    for f in report.findings:
        parts.append(finding_line(f))
    if any(r.peak_bytes >= 0 for r in report.results):
        parts.append(ByWidth(lambda fit: memory_bars(report, 12 if fit.narrow else 32, fit)))
    source = next((f"; peak memory from {r.memory_source}" for r in report.results if r.peak_bytes >= 0), "")
    parts.append(Text(f"[{environment_line(report.environment)}{source}; "
                      f"{report.timed_s:.1f} s of {report.wall_s:.1f} s spent in timed samples]", style="dim"))
    return Group(*parts)


def sweep_table(report, mode: str, seqs: list[int], forced: bool, narrow: bool) -> Table:
    what = "eval + inference_mode, forward" if mode == "infer" else "train mode, forward + backward from grads = None"
    table = table_for(narrow, title=f"tblock bench: {report.subject} - {mode} ({what})", caption_justify="left",
                      caption="on/off: need_weights on / off latency ratio, and peak MiB saved by off" if forced else None)
    run_col = "need_w" if forced else "run"
    cols = [("seq", "right", 5), (run_col, "left", 6), ("ms (IQR)", "right", 13)]
    cols += [("tok/s\nGFLOP/s", "right", 7)] if narrow else [("tok/s", "right", 7), ("GFLOP/s", "right", 7)]
    cols += [("peak\nMiB" if narrow else "peak MiB", "right", 6), ("kernel", "left", 10)]
    for col, just, width in cols:
        table.add_column(col, justify=just, no_wrap=col != "kernel", overflow="fold", min_width=width,
                         ratio=1 if col == "kernel" else None)

    def row(seq, label, lat, tok, gf, peak, kernel):
        table.add_row(seq, label, lat, *([Text.assemble(tok, "\n", (gf, "dim")) if gf else tok] if narrow else [tok, gf]), peak, kernel)

    for seq in seqs:
        for r in (r for r in report.results if r.mode == mode and r.seq == seq):
            lat = Text(f"{r.latency.median * 1e3:,.2f} ({r.latency.iqr * 1e3:,.2f})", style="yellow" if r.noisy else "")
            gflops = f"{r.flops_per_s / 1e9:,.1f}" if r.flops_per_s else "-"
            peak = f"{r.peak_bytes / 2**20:,.1f}" if r.peak_bytes >= 0 else "-"
            row(str(seq), run_label(r), lat, f"{r.tokens_per_s:,.0f}", gflops, peak, r.attention_kernel)
        on_off = report.on_off(mode, seq)
        if on_off:
            ratio, more = on_off
            row("", Text("on/off", style="bold"), Text(f"{ratio:.2f}x", style="bold"), "", "",
                Text(f"{more / 2**20:+,.1f}", style="bold"), "")
        torch_ratio = report.against_torch(mode, seq)
        if torch_ratio:
            mine, ratio = torch_ratio
            row("", Text("vs torch", style="bold"), Text(f"{ratio:.2f}x", style="bold"), "", "", "", f"({run_label(mine)} / torch)")
        table.add_section()
    return table


def decode_view(report, cached, full, fit) -> Group:
    table = PlainTable(title=f"decode: {len(cached.per_position)} tokens after a {cached.seq}-token prompt, batch {report.batch}",
                  box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, width in (("run", 9), ("ms/token (IQR)", 14), ("tok/s", 8), ("growth", 6), ("cache", 10)):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True, min_width=width)
    for r in (cached, full):
        table.add_row(run_label(r), f"{r.latency.median * 1e3:,.3f} ({r.latency.iqr * 1e3:,.3f})", f"{r.tokens_per_s:,.0f}",
                      f"x{r.growth:.2f}", fmt_bytes(r.cache_bytes) if r.cache_bytes is not None else "-")
    lines = [table, Text("per-token time against position (cached / recompute, same scale):", style="bold")]
    top = max(max(cached.per_position), max(full.per_position))
    for r in (cached, full):
        lines.append(Text(f"{run_label(r):>9} {fit.sparkline(_bucket(r.per_position), top)}"))
    if report.decode_analytic_bytes:
        rule = ("traced key + value widths per token x batch x positions x bytes" if report.decode_expected_from == "trace"
                else "2 x layers x batch x positions x d_model x bytes")
        lines.append(Text(f"expected cache: {rule} = {report.decode_analytic_bytes:,} bytes",
                          style="dim"))
    return Group(*lines)


def _bucket(values, n: int = 48) -> list[float]:
    """At most n points: the median of each run of consecutive values."""
    if len(values) <= n:
        return list(values)
    size = len(values) / n
    return [statistics.median(values[int(i * size): max(int(i * size) + 1, int((i + 1) * size))]) for i in range(n)]


def breakdown_view(b, width: int, fit) -> Group:
    table = PlainTable(title=f"breakdown at seq {b.seq} ({b.conditions})", box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, just, w in (("component", "left", 10), ("ms", "right", 8), ("share", "right", 6), ("peak", "right", 9),
                         ("calls", "right", 5), ("", "left", width)):
        table.add_column(col, justify=just, no_wrap=col != "component", overflow="fold", min_width=w)
    top = max((t for _, t, _, _ in b.parts), default=0) or 1
    for comp, t, peak, calls in b.parts:
        bar = fit.bar(max(1, round(width * t / top))) if t > 0 else ""
        table.add_row(comp, f"{t * 1e3:,.2f}", f"{b.share(t):.1%}", fmt_bytes(peak) if peak >= 0 else "-", str(calls),
                      Text(bar, style="cyan"))
    table.add_section()
    table.add_row("sum of parts", f"{b.parts_sum * 1e3:,.2f}", f"{b.share(b.parts_sum):.1%}", "", "", "")
    table.add_row("whole forward", f"{b.whole.median * 1e3:,.2f}", "100%", "", "", "")
    note = Text("the rest of the sum against the whole: the per-call clock's synchronisation and Python overhead; "
                "'other' is views, dropout and elementwise glue between the components", style="dim")
    return Group(table, note)


def comparison_view(report) -> Table:
    table = PlainTable(title="against the saved run", box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, w in (("point", 12), ("latency", 8), ("verdict", 10), ("peak delta", 10)):
        table.add_column(col, justify="left" if col in ("point", "verdict") else "right", overflow="fold", min_width=w)
    for c in report.comparisons:
        verdict = "slower" if c.slower else "faster" if c.faster else "inconclusive (noisy)" if c.inconclusive else "same (noise)"
        if c.memory_grew:
            verdict += ", bigger"
        style = "bold red" if c.slower or c.memory_grew else "yellow" if c.inconclusive else "green"
        table.add_row(c.label, f"{c.ratio:.2f}x" if c.ratio else "-", Text(verdict, style=style),
                      f"{c.memory_delta:+,} B" if c.memory_delta is not None else "-")
    return table


def memory_bars(report, width: int, fit) -> Group:
    """A terminal bar chart of peak memory against seq, one bar per run."""
    rows = [r for r in report.results if r.peak_bytes >= 0]
    if not rows:
        return Group()
    top = max(r.peak_bytes for r in rows) or 1
    lines = [Text("peak memory against seq", style="bold")]
    for r in rows:
        n = max(1, round(width * r.peak_bytes / top)) if r.peak_bytes > 0 else 0
        label = f"{r.mode:5} {r.seq:>6} {run_label(r):11} "
        style = "red" if r.need_weights else ("cyan" if r.target == "block" else "magenta")
        lines.append(Text.assemble(label, (fit.bar(n).ljust(width), style), f" {r.peak_bytes / 2**20:,.1f} MiB"))
    return Group(*lines)


def tp_bench_view(report) -> Group:
    """bench --tp N: per-rank latency of the sharded forward + backward, and the share spent in collectives."""
    table = PlainTable(title=f"tensor-parallel over {len(report.ranks)} ranks, seq {report.seq}: train-mode forward + backward",
                  title_justify="left", box=box.SIMPLE_HEAVY)
    for col in ("rank", "median ms", "vs unsharded", "in collectives"):
        table.add_column(col, justify="right")
    for r in report.ranks:
        table.add_row(str(r.rank), f"{r.median * 1e3:,.2f}", f"x{r.median / report.unsharded_median:.2f}", f"{r.collective_share:.0%}")
    table.add_row("1 process", f"{report.unsharded_median * 1e3:,.2f}", "x1.00", "-")
    env = report.run.environment if report.run else {}
    return Group(table, Text(f"[torch {env.get('torch', '?')}, {env.get('device', '?')}, {env.get('dtype', '?')}; "
                             f"collectives from the profiler's c10d/gloo/NCCL events]", style="dim"))
