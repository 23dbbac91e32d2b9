"""Rich renderables and JSON built from the reports; nothing here computes a measurement."""

from __future__ import annotations

import math

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.units import fmt_bytes

# Below this many columns a table puts its text columns under the names and keeps every number whole.
NARROW = 96


class ByWidth:
    """A renderable that builds itself for the width it is given: build(narrow) -> renderable."""

    def __init__(self, build, threshold: int = NARROW):
        self.build, self.threshold = build, threshold

    def __rich_console__(self, console, options):
        yield self.build(options.max_width < self.threshold)


def table_for(narrow: bool, **kw) -> Table:
    """SIMPLE_HEAVY, left title; narrow: no edge padding and one space between columns."""
    return Table(box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False, collapse_padding=narrow,
                 padding=(0, 1) if not narrow else (0, 0, 0, 1), **kw)

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "error": "bold magenta"}


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
        return f"{v:#.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"
    if isinstance(v, list):
        return "(" + ", ".join(map(str, v)) + ")"
    return str(v)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt_count(n: float) -> str:
    """1234567 -> 1.23M; exact integers below 10,000 as they are."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div and abs(n) >= 1e4:
            return f"{n / div:.3g}{unit}" if n / div < 1000 else f"{n / div:,.0f}{unit}"
    return f"{n:,.0f}"


def status_text(status) -> Text:
    value = getattr(status, "value", status)
    return Text(value, style=STATUS_STYLE.get(value, ""))


def check_view(report) -> Group:
    env = report.run.environment
    table = Table(title=f"tblock check: {report.run.subject}", box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("check", no_wrap=True, min_width=15)
    table.add_column("status", no_wrap=True, min_width=6)
    table.add_column("value", justify="right", no_wrap=True, min_width=9)
    table.add_column("what it means", overflow="fold", ratio=1)
    for c in report.checks:
        table.add_row(c.name, status_text(c.status), fmt_value(c.value), c.detail)
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    verdict = Text("OK" if report.ok else "FAILED", style="bold green" if report.ok else "bold red")
    where = f"torch {env['torch']}, {env['device']}, {env['dtype']}, {plural(env['threads'], 'thread')}"
    tail = Text.assemble(verdict, f"  {counts}" + ("  (--strict: warnings fail)" if report.strict else "") + f"  [{where}]")
    return Group(table, tail)


GROUP_STYLE = {"attention": "cyan", "ffn": "magenta", "norm": "green", "other": "yellow", "mixed": "yellow"}


def params_view(report) -> Group:
    return Group(ByWidth(lambda narrow: params_table(report, narrow)), *params_lines(report))


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

    def row(name, role, params: str, share: str, nbytes: str, flops: str, shape: str = "", group: str = ""):
        role_text = Text(role, style=GROUP_STYLE.get(group, ""))
        if narrow:
            first = Text(name) if not (role or shape) else Text.assemble(name, "\n", (" ".join(x for x in (role, shape) if x), "dim"))
            table.add_row(first, params, share, nbytes, flops)
        else:
            table.add_row(name, role_text, params, share, nbytes, flops, shape)

    for c in (c for c in report.components if c.name != "final_ln" or not stack):
        flops = fmt_count(c.flops_per_token) + (" *" if c.grows_with_seq else "")
        share = c.params * report.layers / report.total if report.total else 0
        shape = "(" + ", ".join(map(str, c.out_shape)) + ")" if c.out_shape else ""
        row(c.name, c.role or c.group, f"{c.params:,}", f"{share:.1%}", fmt_bytes(c.bytes), flops, shape, c.group)
    table.add_section()
    if stack:
        layer_rows = [c for c in report.components if c.name != "final_ln"]
        layer_params = sum(c.params for c in layer_rows)
        row("one layer", "", f"{layer_params:,}", f"{layer_params / report.total:.1%}", fmt_bytes(sum(c.bytes for c in layer_rows)),
            fmt_count(sum(c.flops_per_token for c in layer_rows)))
        for c in report.components:
            if c.name == "final_ln":
                row(c.name, "norm", f"{c.params:,}", f"{c.params / report.total:.1%}", fmt_bytes(c.bytes), "0", group="norm")
        table.add_section()
    for g, n in report.groups.items():
        if n:
            row(g, "all layers" if stack else "subtotal", f"{n:,}", f"{n / report.total:.1%}",
                fmt_bytes(n * report.total_bytes / report.total), "", group=g)
    table.add_section()
    row("total", "", f"{report.total:,}", "100%", fmt_bytes(report.total_bytes), "")
    return table


def params_lines(report) -> list:
    f = report.flops
    lines = [Text(report.ffn_note, style="bold" if report.ffn_share is not None else "dim")]
    for chain in report.linear_chains:
        a, b = chain.split(" -> ")
        lines.append(Text(f"warning: `{a}` and `{b}` compose to one linear map: no nonlinearity between the FFN's projections",
                          style="yellow"))
    lines.append(Text(f"FLOPs at batch {report.batch} x seq {report.seq} ({report.flops_source}; a multiply-add = 2; matmuls only, "
                      f"norms, softmax and activations add O(d) per token): forward {fmt_count(f['forward'])}, "
                      f"training step (forward + backward) {fmt_count(f['train_step'])}"))
    if f.get("forward_seq_quadratic"):
        lines.append(Text(f"* grows with seq^2: attention scores and mix, {fmt_count(f['forward_seq_quadratic'])} "
                          f"of the forward ({f['forward_seq_quadratic'] / f['forward']:.1%} at seq {report.seq})"))
    kv = report.kv_cache
    if kv:
        lines.append(Text(f"KV cache for decoding: {fmt_bytes(kv['bytes_per_token'])} per token per sequence "
                          f"({kv['bytes_per_token']:,} bytes); {fmt_bytes(kv['bytes_at_seq'])} at batch {kv['batch']} x seq {kv['seq']}, "
                          f"beside {fmt_bytes(report.total_bytes)} of parameters"))
    return lines


def presets_view(presets: dict) -> Table:
    table = Table(title="presets (sources in tblock_cli/config.py)", box=box.SIMPLE_HEAVY, title_justify="left")
    keys = ("d_model", "n_heads", "d_ff", "layers", "norm", "activation", "eps", "causal")
    table.add_column("name", no_wrap=True)
    for k, header in zip(keys, ("d_model", "heads", "d_ff", "layers", "norm", "act", "eps", "causal")):
        table.add_column(header, justify="left" if k in ("norm", "activation", "causal") else "right", no_wrap=True)
    for name, p in presets.items():
        table.add_row(name, *(str(p.get(k, False if k == "causal" else "")) for k in keys))
    return table


def _run_label(r) -> str:
    if r.target == "torch":
        return "torch"
    if r.mode == "decode":
        return "cached" if r.kv_cache else "recompute"
    return {None: "as written", True: "on", False: "off"}[r.need_weights]


def finding_line(f, indent: str = "") -> Text:
    status = getattr(f.status, "value", f.status)
    return Text(f"{indent}{'!' if status == 'warn' else '-'} {f.text}", style=FINDING_STYLE.get(status, ""))


def bench_view(report) -> Group:
    parts: list = []
    modes = [m for m in ("infer", "train") if any(r.mode == m for r in report.results)]
    seqs = sorted({r.seq for r in report.results if r.mode != "decode"})
    forced = any(r.need_weights is not None for r in report.results)
    for mode in modes:
        parts.append(ByWidth(lambda narrow, mode=mode: sweep_table(report, mode, seqs, forced, narrow)))
    if seqs:
        sizes = "; ".join(f"seq {s}: need_weights=True returns (B, L, L) = {fmt_bytes(v['weights_returned'])}, "
                          f"one (B, H, L, L) matrix = {fmt_bytes(v['matrix_per_head'])}" for s, v in report.attention_bytes.items())
        parts.append(Text(f"Analytic sizes at batch {report.batch}, {report.heads} heads: {sizes}", style="dim"))
    decode = report.decode_pair()
    if decode:
        parts.append(decode_view(report, *decode))
    for b in report.breakdowns:
        parts.append(ByWidth(lambda narrow, b=b: breakdown_view(b, 8 if narrow else 24)))
    if report.comparisons is not None:
        parts.append(comparison_view(report))
    for f in report.findings():
        parts.append(finding_line(f))
    if any(r.peak_bytes >= 0 for r in report.results):
        parts.append(ByWidth(lambda narrow: memory_bars(report, 12 if narrow else 32)))
    env = report.environment
    source = next((f"; peak memory from {r.memory_source}" for r in report.results if r.peak_bytes >= 0), "")
    parts.append(Text(f"[torch {env['torch']}, {env['device']}, {env['dtype']}, {plural(env['threads'], 'thread')}{source}; "
                      f"{report.timed_s:.1f} s of {report.wall_s:.1f} s spent in timed samples]", style="dim"))
    return Group(*parts)


def tp_bench_view(report) -> Group:
    """bench --tp N: per-rank latency of the sharded forward + backward, and the share spent in collectives."""
    table = Table(title=f"tensor-parallel over {len(report.ranks)} ranks, seq {report.seq}: train-mode forward + backward",
                  title_justify="left")
    for col in ("rank", "median ms", "vs unsharded", "in collectives"):
        table.add_column(col, justify="right")
    for r in report.ranks:
        table.add_row(str(r.rank), f"{r.median * 1e3:,.2f}", f"x{r.median / report.unsharded_median:.2f}", f"{r.collective_share:.0%}")
    table.add_row("1 process", f"{report.unsharded_median * 1e3:,.2f}", "x1.00", "-")
    env = report.run.environment if report.run else {}
    return Group(table, Text(f"[torch {env.get('torch', '?')}, {env.get('device', '?')}, {env.get('dtype', '?')}; "
                             f"collectives from the profiler's c10d/gloo/NCCL events]", style="dim"))


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
        rows = [r for r in report.results if r.mode == mode and r.seq == seq]
        for r in rows:
            lat = Text(f"{r.latency.median * 1e3:,.2f} ({r.latency.iqr * 1e3:,.2f})", style="yellow" if r.noisy else "")
            gflops = f"{r.flops_per_s / 1e9:,.1f}" if r.flops_per_s else "-"
            peak = f"{r.peak_bytes / 2**20:,.1f}" if r.peak_bytes >= 0 else "-"
            row(str(seq), _run_label(r), lat, f"{r.tokens_per_s:,.0f}", gflops, peak, r.attention_kernel)
        pair = report.pair(mode, seq)
        if pair:
            off, on = pair
            row("", Text("on/off", style="bold"), Text(f"{on.latency.median / off.latency.median:.2f}x", style="bold"), "", "",
                Text(f"{(on.peak_bytes - off.peak_bytes) / 2**20:+,.1f}", style="bold"), "")
        base = next((r for r in rows if r.target == "torch"), None)
        mine = next((r for r in rows if r.target == "block" and r.need_weights in (None, False)), None)
        if base and mine:
            row("", Text("vs torch", style="bold"), Text(f"{mine.latency.median / base.latency.median:.2f}x", style="bold"),
                "", "", "", f"({_run_label(mine)} / torch)")
        table.add_section()
    return table


def decode_view(report, cached, full) -> Group:
    table = Table(title=f"decode: {len(cached.per_position)} tokens after a {cached.seq}-token prompt, batch {report.batch}",
                  box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, width in (("run", 9), ("ms/token (IQR)", 14), ("tok/s", 8), ("growth", 6), ("cache", 10)):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True, min_width=width)
    from tblock_cli.benchmark.report import growth

    for r in (cached, full):
        table.add_row(_run_label(r), f"{r.latency.median * 1e3:,.3f} ({r.latency.iqr * 1e3:,.3f})", f"{r.tokens_per_s:,.0f}",
                      f"x{growth(r.per_position):.2f}", fmt_bytes(r.cache_bytes) if r.cache_bytes is not None else "-")
    lines = [table, Text("per-token time against position (cached / recompute, same scale):", style="bold")]
    top = max(max(cached.per_position), max(full.per_position))
    for r in (cached, full):
        lines.append(Text(f"{_run_label(r):>9} {sparkline(_bucket(r.per_position), top)}"))
    if report.decode_analytic_bytes:
        lines.append(Text(f"analytic cache: 2 x layers x batch x positions x d_model x bytes = {report.decode_analytic_bytes:,} bytes",
                          style="dim"))
    return Group(*lines)


def _bucket(values, n: int = 48) -> list[float]:
    """At most n points: the median of each run of consecutive values."""
    import statistics

    if len(values) <= n:
        return list(values)
    size = len(values) / n
    return [statistics.median(values[int(i * size): max(int(i * size) + 1, int((i + 1) * size))]) for i in range(n)]


def breakdown_view(b, width: int = 24) -> Group:
    table = Table(title=f"breakdown at seq {b.seq} ({b.conditions})", box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, just, w in (("component", "left", 10), ("ms", "right", 8), ("share", "right", 6), ("peak", "right", 9),
                         ("calls", "right", 5), ("", "left", width)):
        table.add_column(col, justify=just, no_wrap=col != "component", overflow="fold", min_width=w)
    top = max((t for _, t, _, _ in b.parts), default=0) or 1
    for comp, t, peak, calls in b.parts:
        bar = "█" * max(1, round(width * t / top)) if t > 0 else ""
        table.add_row(comp, f"{t * 1e3:,.2f}", f"{t / b.whole.median:.1%}", fmt_bytes(peak) if peak >= 0 else "-", str(calls),
                      Text(bar, style="cyan"))
    table.add_section()
    table.add_row("sum of parts", f"{b.parts_sum * 1e3:,.2f}", f"{b.parts_sum / b.whole.median:.1%}", "", "", "")
    table.add_row("whole forward", f"{b.whole.median * 1e3:,.2f}", "100%", "", "", "")
    note = Text("the rest of the sum against the whole: the per-call clock's synchronisation and Python overhead; "
                "'other' is views, dropout and elementwise glue between the components", style="dim")
    return Group(table, note)


def comparison_view(report) -> Table:
    table = Table(title="against the saved run", box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for col, w in (("point", 12), ("latency", 8), ("verdict", 10), ("peak delta", 10)):
        table.add_column(col, justify="left" if col in ("point", "verdict") else "right", overflow="fold", min_width=w)
    for c in report.comparisons:
        verdict = "slower" if c.slower else "faster" if c.faster else "same (noise)"
        if c.memory_grew:
            verdict += ", bigger"
        style = "bold red" if c.slower or c.memory_grew else "green"
        table.add_row(c.label, f"{c.ratio:.2f}x" if c.ratio else "-", Text(verdict, style=style),
                      f"{c.memory_delta:+,} B" if c.memory_delta is not None else "-")
    return table


def memory_bars(report, width: int = 32) -> Group:
    """A terminal bar chart of peak memory against seq, one bar per run."""
    rows = [r for r in report.results if r.peak_bytes >= 0]
    if not rows:
        return Group()
    top = max(r.peak_bytes for r in rows) or 1
    lines = [Text("peak memory against seq", style="bold")]
    for r in rows:
        n = max(1, round(width * r.peak_bytes / top)) if r.peak_bytes > 0 else 0
        label = f"{r.mode:5} {r.seq:>6} {_run_label(r):11} "
        style = "red" if r.need_weights else ("cyan" if r.target == "block" else "magenta")
        lines.append(Text.assemble(label, (("█" * n).ljust(width), style), f" {r.peak_bytes / 2**20:,.1f} MiB"))
    return Group(*lines)


def save_plot(report, path: str) -> None:
    """Peak memory and median latency against seq, one line per run kind; decode: per-token time against position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in report.results if r.mode != "decode"]
    decode = report.decode_pair()
    axes_n = (2 if sweep else 0) + (1 if decode else 0)
    fig, axes = plt.subplots(1, axes_n, figsize=(5 * axes_n, 4), squeeze=False)
    axes = list(axes[0])
    if sweep:
        ax_mem, ax_lat = axes[0], axes[1]
        kinds = sorted({(r.mode, r.target, r.need_weights) for r in sweep}, key=str)
        for mode, target, nw in kinds:
            rs = sorted((r for r in sweep if (r.mode, r.target, r.need_weights) == (mode, target, nw)), key=lambda r: r.seq)
            label = f"{mode}, " + ("torch layer" if target == "torch" else f"need_weights {_run_label(rs[0])}")
            style = "--" if mode == "train" else "-"
            ax_mem.plot([r.seq for r in rs], [r.peak_bytes / 2**20 for r in rs], style, marker="o", label=label)
            ax_lat.plot([r.seq for r in rs], [r.latency.median * 1e3 for r in rs], style, marker="o", label=label)
        for ax, ylabel in ((ax_mem, "peak memory (MiB)"), (ax_lat, "median latency (ms)")):
            ax.set_xlabel("seq")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        ax_mem.legend(fontsize=7)
    if decode:
        ax = axes[-1]
        for r in decode:
            ax.plot(range(r.seq, r.seq + len(r.per_position)), [t * 1e3 for t in r.per_position], label=_run_label(r))
        ax.set_xlabel("position")
        ax.set_ylabel("ms per token")
        ax.set_title("decode: per-token latency", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    env = report.environment
    fig.suptitle(f"tblock bench: {report.subject} (batch {report.batch}, {env['device']}, {env['dtype']}, {plural(env['threads'], 'thread')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float | None = None) -> str:
    """Heights from zero to the largest value (or to `top`, to share a scale), so equal values look equal."""
    hi = max(max(values), 0.0) if top is None else top
    if hi <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[max(0, min(7, round(v / hi * 8) - 1))] for v in values)


FINDING_STYLE = {"info": "", "warn": "yellow"}


def depth_view(report, width: int = 16) -> Group:
    table = Table(title=f"tblock depth: {report.subject} (forward + backward at init, dropout off)", box=box.SIMPLE_HEAVY,
                  title_justify="left", pad_edge=False)
    for col in ("layer", "norm", "act RMS", "grad in", "grad par", "gain", "grad in"):
        table.add_column(col, justify="left" if col == "norm" or col == "grad in" and table.columns and table.columns[-1].header == "gain" else "right", no_wrap=True)
    top = max(s.grad_input_norm for s in report.layers) or 1.0
    prev = None
    for s in report.layers:
        changed = prev is not None and s.placement != prev
        placement = Text(s.placement + (" <" if changed else ""), style="yellow" if changed else "")
        bar = "█" * max(1, round(width * s.grad_input_norm / top))
        table.add_row(str(s.index), placement, f"{s.act_rms:.3f}", f"{s.grad_input_norm:.4g}", f"{s.grad_param_norm:.4g}",
                      f"{s.residual_gain:.3f}", Text(bar, style="cyan"))
        prev = s.placement
    if report.final_norm:
        table.add_section()
        table.add_row("final", "LayerNorm", f"{report.final_rms:.3f}", "", "", "", "")
    lines = [table]
    for f in report.findings:
        lines.append(finding_line(f))
    if not report.ok:
        lines.append(Text("FAILED (--strict: warnings fail)", style="bold red"))
    return Group(*lines)


def depth_compare_view(reports: list) -> Group:
    n = len(reports[0].layers)
    table = Table(title=f"tblock depth --compare: {n} layers at init (act RMS / grad-in norm per layer)", box=box.SIMPLE_HEAVY,
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
    lines = [table, Text("* the layer's output is normalised (detected Post-LN)", style="dim")]
    for r in reports:
        lines.append(Text(f"{r.norm:>6}: act {sparkline([s.act_rms for s in r.layers])}  grad {sparkline([s.grad_input_norm for s in r.layers])}"))
    for r in reports:
        lines.append(Text(f"{r.norm}:", style="bold"))
        for f in r.findings:
            lines.append(finding_line(f, "  "))
    return Group(*lines)


def save_depth_plot(reports: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for r in reports:
        idx = [s.index for s in r.layers]
        axes[0].plot(idx, [s.act_rms for s in r.layers], marker="o", label=r.norm)
        axes[1].plot(idx, [s.grad_input_norm for s in r.layers], marker="o", label=r.norm)
        axes[2].plot(idx, [s.grad_param_norm for s in r.layers], marker="o", label=r.norm)
    for ax, title in zip(axes, ("activation RMS", "gradient norm at layer input", "parameter gradient norm")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
