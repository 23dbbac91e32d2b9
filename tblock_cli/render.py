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

from tblock_cli.units import fmt_bytes

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
        return f"{v:#.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"
    if isinstance(v, list):
        return "(" + ", ".join(map(str, v)) + ")"
    return str(v)


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


def params_json(report) -> dict:
    return {
        "components": [{"name": c.name, "group": c.group, "params": c.params, "bytes": c.bytes, "flops_per_token": c.flops_per_token}
                       for c in report.components],
        "total": report.total, "total_bytes": report.total_bytes, "layers": report.layers, "groups": report.groups,
        "ffn_share": report.ffn_share, "ffn_note": report.ffn_note, "flops": report.flops, "flops_source": report.flops_source,
    }


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
    return {None: "as written", True: "on", False: "off"}[r.need_weights]


def bench_view(report) -> Group:
    parts: list = []
    modes = [m for m in ("infer", "train") if any(r.mode == m for r in report.results)]
    seqs = sorted({r.seq for r in report.results})
    forced = any(r.need_weights is not None for r in report.results)
    for mode in modes:
        what = "eval + inference_mode, forward" if mode == "infer" else "train mode, forward + backward"
        table = Table(title=f"tblock bench: {report.subject} - {mode} ({what})", box=box.SIMPLE_HEAVY, title_justify="left",
                      pad_edge=False, caption="on/off: need_weights on / off latency ratio, and peak MiB saved by off" if forced else None,
                      caption_justify="left")
        for col, just in (("seq", "right"), ("need_w" if forced else "run", "left"), ("ms (IQR)", "right"),
                          ("tok/s", "right"), ("GFLOP/s", "right"), ("peak MiB", "right"), ("kernel", "left")):
            table.add_column(col, justify=just, no_wrap=col != "kernel", overflow="fold")
        for seq in seqs:
            rows = [r for r in report.results if r.mode == mode and r.seq == seq]
            for r in rows:
                lat = Text(f"{r.latency.median * 1e3:,.2f} ({r.latency.iqr * 1e3:,.2f})", style="yellow" if r.latency.noisy else "")
                gflops = f"{r.flops_per_s / 1e9:,.1f}" if r.flops_per_s else "-"
                peak = f"{r.peak_bytes / 2**20:,.1f}" if r.peak_bytes >= 0 else "-"
                table.add_row(str(seq), _run_label(r), lat, f"{r.tokens_per_s:,.0f}", gflops, peak, r.attention_kernel)
            pair = report.pair(mode, seq)
            if pair:
                off, on = pair
                table.add_row("", Text("on/off", style="bold"), Text(f"{on.latency.median / off.latency.median:.2f}x", style="bold"), "", "",
                              Text(f"{(on.peak_bytes - off.peak_bytes) / 2**20:+,.1f}", style="bold"), "")
            base = next((r for r in rows if r.target == "torch"), None)
            mine = next((r for r in rows if r.target == "block" and r.need_weights in (None, False)), None)
            if base and mine:
                table.add_row("", Text("vs torch", style="bold"), Text(f"{mine.latency.median / base.latency.median:.2f}x", style="bold"),
                              "", "", "", f"({_run_label(mine)} / torch)")
            table.add_section()
        parts.append(table)
    sizes = "; ".join(f"seq {s}: need_weights=True returns (B, L, L) = {fmt_bytes(v['weights_returned'])}, "
                      f"one (B, H, L, L) matrix = {fmt_bytes(v['matrix_per_head'])}" for s, v in report.attention_bytes.items())
    parts.append(Text(f"Analytic sizes at batch {report.batch}, {report.heads} heads: {sizes}", style="dim"))
    for f in report.findings():
        parts.append(Text(f"- {f}"))
    noisy = [r for r in report.results if r.latency.noisy]
    if noisy:
        parts.append(Text(f"warning: {len(noisy)} measurement(s) have IQR > 10% of the median (yellow): the machine was busy "
                          f"or --min-time is short; medians are still shown", style="yellow"))
    parts.append(memory_bars(report))
    env = report.environment
    parts.append(Text(f"[torch {env['torch']}, {env['device']}, {env['dtype']}, {env['threads']} threads; "
                      f"peak memory from {report.results[0].memory_source}]", style="dim"))
    return Group(*parts)


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


def bench_json(report) -> dict:
    return {
        "subject": report.subject,
        "results": [
            {
                "mode": r.mode, "seq": r.seq, "need_weights": r.need_weights, "target": r.target,
                "latency_ms": {"median": r.latency.median * 1e3, "iqr": r.latency.iqr * 1e3,
                               "samples": [s * 1e3 for s in r.latency.samples], "noisy": r.latency.noisy},
                "peak_bytes": r.peak_bytes, "memory_source": r.memory_source,
                "attention_kernel": r.attention_kernel, "materialises_attention": r.materialises,
                "tokens_per_s": r.tokens_per_s, "flops": r.flops, "flops_per_s": r.flops_per_s,
            }
            for r in report.results
        ],
        "attention_bytes": report.attention_bytes,
        "findings": report.findings(),
        "environment": report.environment,
    }


def save_plot(report, path: str) -> None:
    """Peak memory and median latency against seq, one line per run kind (matplotlib, optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    kinds = sorted({(r.mode, r.target, r.need_weights) for r in report.results}, key=str)
    for mode, target, nw in kinds:
        rs = sorted((r for r in report.results if (r.mode, r.target, r.need_weights) == (mode, target, nw)), key=lambda r: r.seq)
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
    env = report.environment
    fig.suptitle(f"tblock bench: {report.subject} (batch {report.batch}, {env['device']}, {env['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """Heights from zero to the largest value, so equal values look equal and noise stays small."""
    hi = max(max(values), 0.0)
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
        lines.append(Text(f"{'!' if f.status == 'warn' else '-'} {f.text}", style=FINDING_STYLE[f.status]))
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
            lines.append(Text(f"  {'!' if f.status == 'warn' else '-'} {f.text}", style=FINDING_STYLE[f.status]))
    return Group(*lines)


def depth_json(report) -> dict:
    return {
        "subject": report.subject,
        "norm": report.norm,
        "layers": [{"index": s.index, "placement": s.placement, "act_rms": s.act_rms, "grad_input_norm": s.grad_input_norm,
                    "grad_param_norm": s.grad_param_norm, "residual_gain": s.residual_gain,
                    "token_mean": s.token_mean, "token_std_dev": s.token_std_dev} for s in report.layers],
        "final_norm": report.final_norm,
        "final_rms": report.final_rms,
        "findings": [{"status": f.status, "text": f.text} for f in report.findings],
        "ok": report.ok,
    }


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
