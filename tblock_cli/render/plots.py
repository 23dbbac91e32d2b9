"""Charts saved with --plot (matplotlib, imported only when a chart is asked for)."""

from __future__ import annotations

from tblock_cli.render.bench import run_label
from tblock_cli.render.common import plural


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(report, path: str) -> None:
    """Peak memory and median latency against seq, one line per run kind; decode: per-token time against position."""
    plt = _pyplot()
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
            label = f"{mode}, " + ("torch layer" if target == "torch" else f"need_weights {run_label(rs[0])}")
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
            ax.plot(range(r.seq, r.seq + len(r.per_position)), [t * 1e3 for t in r.per_position], label=run_label(r))
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


def save_depth_plot(reports: list, path: str) -> None:
    plt = _pyplot()
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
