"""--html FILE: one self-contained page per report, built from the same dict as --json (tables, findings, SVG figures).

No scripts, no external fonts, images or styles: it opens from a CI artifact offline and prints to PDF as it shows.
The output is well-formed XML (every tag closed, text escaped), so a strict parser reads it back.
"""

from __future__ import annotations

import math
from html import escape

from tblock_cli.render import svg
from tblock_cli.report import dumps

# Marks a file as one of tblock's reports: --html overwrites only such a file (bench --save's rule for its JSON).
GENERATOR = "tblock html report"
MARK = f'<meta name="generator" content="{GENERATOR}"/>'
HEAD_BYTES = 4096  # the mark sits in <head>, within the first few hundred bytes
LIST_SHOWN = 12  # a list value longer than this is cut in a table cell (the JSON keeps it whole)
FLAT_KEYS = ("schema_version", "command", "ok", "subject", "config", "environment", "warnings", "findings")

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #1b1f24;
       max-width: 60rem; margin: 1.5rem auto; padding: 0 1rem; line-height: 1.4; }
h1 { font-size: 1.5rem; margin: 0 0 0.25rem; } h2 { font-size: 1.15rem; margin: 1.6rem 0 0.5rem; border-bottom: 1px solid #d0d7de; }
.meta { color: #57606a; font-size: 0.9rem; margin: 0 0 1rem; }
.verdict { display: inline-block; padding: 0.1rem 0.6rem; border-radius: 1rem; font-weight: 600; color: #fff; }
.verdict.ok { background: #1a7f37; } .verdict.not-ok { background: #cf222e; }
table { border-collapse: collapse; width: 100%; font-size: 0.88rem; margin: 0.3rem 0 1rem; }
th, td { text-align: left; padding: 0.25rem 0.5rem; border-bottom: 1px solid #eaeef2; vertical-align: top; }
th { background: #f6f8fa; } table.kv { width: auto; min-width: 50%; } table.kv th { padding-right: 2rem; }
h3 { font-size: 0.95rem; margin: 0.8rem 0 0.2rem; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.s-pass, li.s-pass::marker { color: #1a7f37; } td.s-warn, li.s-warn::marker { color: #9a6700; }
td.s-fail, li.s-fail::marker, td.s-error { color: #cf222e; font-weight: 600; } td.s-skip { color: #6e7781; }
td.status { white-space: nowrap; font-weight: 600; }
ul.findings li { margin: 0.2rem 0; } .tag { font-size: 0.75rem; color: #57606a; }
.figures { display: grid; grid-template-columns: repeat(auto-fit, minmax(24rem, 1fr)); gap: 0 1.2rem; }
figure { margin: 0.8rem 0 1.2rem; break-inside: avoid; } figure.wide { grid-column: 1 / -1; } svg.strip { width: 100%; } figcaption { font-size: 0.85rem; color: #57606a; }
svg.chart { max-width: 100%; height: auto; font-size: 11px; font-family: inherit; }
svg .frame { fill: none; stroke: #8c959f; } svg .grid { stroke: #eaeef2; } svg .line { fill: none; stroke-width: 2; }
svg .tick, svg .legend { fill: #1b1f24; } svg .axis { fill: #57606a; font-size: 12px; } svg .chart-title { font-weight: 600; font-size: 13px; }
svg .bar { fill: #0072b2; } svg .limit { stroke: #cf222e; stroke-dasharray: 4 3; } svg .strip { fill: #fff; font-weight: 600; }
svg .s-pass { fill: #1a7f37; } svg .s-warn { fill: #bf8700; } svg .s-fail { fill: #cf222e; } svg .s-error { fill: #8250df; }
svg .s-skip { fill: #8c959f; }
details { margin: 0.5rem 0; } summary { cursor: default; color: #57606a; }
pre { background: #f6f8fa; padding: 0.6rem; overflow-x: auto; font-size: 0.8rem; }
@media print { body { max-width: none; margin: 0; } h2 { break-after: avoid; } tr, li { break-inside: avoid; }
               * { -webkit-print-color-adjust: exact; print-color-adjust: exact; } details > pre { display: none; } }
"""


def cell(v) -> str:
    """A value as table text: numbers to 4 significant digits, lists joined (long ones cut), None as a dash."""
    if v is None:
        return "\u2014"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)):
        shown = ", ".join(cell(x) for x in v[:LIST_SHOWN])
        return shown + (f", \u2026 ({len(v)} in all)" if len(v) > LIST_SHOWN else "")
    if isinstance(v, dict):
        return "; ".join(f"{k} {cell(x)}" for k, x in v.items())
    return str(v)


def _td(v, status: bool = False) -> str:
    if status and isinstance(v, str):
        return f'<td class="status s-{escape(v)}">{escape(v)}</td>'
    numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
    return ('<td class="num">' if numeric else "<td>") + escape(cell(v)) + "</td>"


def table(rows: list[dict], columns: list[str] | None = None, headers: dict | None = None) -> str:
    """Rows of dicts as a table; `columns` picks and orders them (default: every key of the rows, in order)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{escape((headers or {}).get(c, c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_td(r.get(c), status=c == "status") for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_values(d: dict) -> str:
    """A dict as two columns; a value that is itself a list of rows becomes a table of its own below."""
    rows = {k: v for k, v in d.items() if not _rows(v)}
    out = '<table class="kv"><tbody>' + "".join(f"<tr><th>{escape(str(k))}</th>{_td(v)}</tr>" for k, v in rows.items()) + \
        "</tbody></table>" if rows else ""
    return out + "".join(f"<h3>{escape(str(k))}</h3>{table(v)}" for k, v in d.items() if _rows(v))


def _rows(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(r, dict) for r in v)


def section(title: str, inner: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{inner}</section>" if inner else ""


def findings(items: list[dict]) -> str:
    lis = "".join(f'<li class="s-{escape(f.get("status", ""))}"><strong>{escape(f.get("status", ""))}</strong> '
                  f'{escape(f.get("text", ""))} <span class="tag">{escape(f.get("kind", ""))}</span></li>' for f in items)
    return f'<ul class="findings">{lis}</ul>' if lis else ""


def figure(chart: str, caption: str, wide: bool = False) -> str:
    return ('<figure class="wide">' if wide else "<figure>") + f"{chart}<figcaption>{escape(caption)}</figcaption></figure>"


def _numbers(points) -> tuple[tuple[float, float], ...]:
    return tuple((float(x), float(y)) for x, y in points if isinstance(y, (int, float)) and not isinstance(y, bool))


# --- per command: figures and tables, each from the report's dict -------------------------------------------------

def check_parts(d: dict) -> tuple[list[str], list[str]]:
    counts = [(s, n) for s, n in (d.get("counts") or {}).items()]
    figs = [figure(svg.status_strip(counts, title="checks by status"), "Each check of the battery, by its status.", wide=True)]
    rows = [{"check": c["name"], "status": c["status"], "value": c.get("value"), "what it found": c.get("detail"),
             "s": c.get("seconds")} for c in d.get("checks", [])]
    return figs, [section("Checks", table(rows))]


def _depth_series(layers: list[dict], key: str, name: str) -> svg.Series:
    return svg.Series(name, _numbers((r["index"], r.get(key)) for r in layers))


def depth_parts(d: dict) -> tuple[list[str], list[str]]:
    stacks = d["compare"] if "compare" in d else [d]
    label = (lambda s: s.get("norm") or s.get("subject") or "stack")
    figs = []
    for key, what, log in (("act_rms", "activation RMS after each layer", True),
                           ("grad_input_norm", "gradient norm at each layer's input", True),
                           ("residual_gain", "residual gain tr(J)/n of each layer", False)):
        series = [_depth_series(s.get("layers", []), key, label(s)) for s in stacks]
        if any(s.points for s in series):
            figs.append(figure(svg.line_chart(series, title=what, x_label="layer", y_label=key, log_y=log), what[0].upper() + what[1:] + "."))
    tables = [section(f"Layers ({label(s)})" if len(stacks) > 1 else "Layers", table(s.get("layers", []))) for s in stacks]
    tables += [section(f"Findings ({label(s)})", findings(s.get("findings", []))) for s in stacks if len(stacks) > 1]
    return figs, tables


def _bench_label(r: dict) -> str:
    extra = "" if r.get("need_weights") is None else f" need_weights {'on' if r['need_weights'] else 'off'}"
    extra += "" if r.get("target", "block") == "block" else f" ({r['target']})"
    extra += "" if r.get("kv_cache") is None else (" cached" if r["kv_cache"] else " recomputed")
    return f"{r.get('mode', '')}{extra}"


def bench_parts(d: dict) -> tuple[list[str], list[str]]:
    results = d.get("results") or []
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(_bench_label(r), []).append(r)
    seqs = sorted({r["seq"] for r in results if isinstance(r.get("seq"), int)})
    log_x = len(seqs) > 1 and seqs[-1] / seqs[0] >= 8
    ticks = [float(s) for s in seqs] if 1 < len(seqs) <= 8 else None
    figs = []
    for key, what, unit, scale in (("latency", "median latency against sequence length", "ms", 1.0),
                                   ("peak_bytes", "peak memory against sequence length", "MiB", 1 / 2**20)):
        series = [svg.Series(name, _numbers((r["seq"], (r.get("latency_ms") or {}).get("median") if key == "latency"
                                             else (r[key] * scale if isinstance(r.get(key), int) else None)) for r in rs))
                  for name, rs in groups.items()]
        if len(seqs) > 1 and any(s.points for s in series):
            figs.append(figure(svg.line_chart(series, title=what, x_label="sequence length (tokens)", y_label=unit,
                                              log_x=log_x, log_y=log_x, x_ticks=ticks, from_zero=True),
                               what[0].upper() + what[1:] + f" ({unit})."))
    rows = [{"mode": _bench_label(r), "seq": r.get("seq"), "median ms": (r.get("latency_ms") or {}).get("median"),
             "IQR ms": (r.get("latency_ms") or {}).get("iqr"), "peak MiB": r["peak_bytes"] / 2**20 if isinstance(r.get("peak_bytes"), int) else None,
             "tokens/s": r.get("tokens_per_s"), "attention kernel": r.get("attention_kernel")} for r in results]
    return figs, [section("Measurements", table(rows))] if rows else []


def compare_parts(d: dict) -> tuple[list[str], list[str]]:
    comps = [c for c in d.get("components") or [] if isinstance(c.get("rel"), (int, float))]
    tol = next((c.get("tol") for c in d.get("comparisons") or [] if isinstance(c.get("tol"), (int, float))), None)
    figs = []
    if comps:
        bars = [(c["component"], float(c["rel"])) for c in comps]
        log = all(v > 0 for _, v in bars) and max(v for _, v in bars) / min(v for _, v in bars) > 20
        figs.append(figure(svg.bar_chart(bars, title="relative error per component (B against A)", x_label="relative error",
                                         log=log, limit=("tolerance", float(tol)) if tol else None),
                           "Each role output of B against A's, in dataflow order: the first to jump is where they part."))
    return figs, [section("Comparisons", table(d.get("comparisons") or [])), section("Components", table(d.get("components") or []))]


def spec_parts(d: dict) -> tuple[list[str], list[str]]:
    card = d.get("card") or {}
    entries = {e["key"]: e for e in card.get("entries", [])}
    value = lambda k: (entries.get(k) or {}).get("value")  # noqa: E731
    figs = []
    freqs, theta, dims = value("rope.freqs"), value("rope.theta"), value("rope.dims")
    if isinstance(freqs, list) and freqs:
        series = [svg.Series("measured", _numbers(enumerate(freqs)))]
        if isinstance(theta, (int, float)) and isinstance(dims, (int, float)) and dims > 0:
            curve = [(i, theta ** (-2 * i / dims)) for i in range(len(freqs))]
            series.append(svg.Series(f"theta {theta:g}", tuple(curve), dashed=True, markers=False))
        reference = {e["key"]: e.get("value") for e in (d.get("reference") or {}).get("entries", [])}
        claimed = reference.get("rope.freqs")
        if isinstance(claimed, list) and claimed and claimed != freqs:
            series.append(svg.Series(f"{d.get('like')}", _numbers(enumerate(claimed))))
        figs.append(figure(svg.line_chart(series, title="rotary frequency per pair", x_label="pair i",
                                          y_label="radians per position", log_y=True),
                           "Each rotating pair's frequency, read from the block, against theta^(-2i/dims), the curve "
                           "of the theta read (dashed), and the --like reference's where they differ."))
    curve = value("relbias.curve")
    if isinstance(curve, list) and curve:
        half = (len(curve) - 1) // 2
        figs.append(figure(svg.line_chart([svg.Series("head 0", _numbers((i - half, v) for i, v in enumerate(curve)))],
                                          title="relative position bias (head 0)", x_label="key - query", y_label="bias"),
                           "The bias added to the scores against distance."))
    rows = [{"entry": e["key"], "value": e.get("value") if e.get("skip") is None else None,
             "how it was read": e.get("how") or e.get("skip")} for e in card.get("entries", [])]
    tables = [section("Verdicts", table(d["verdicts"])) if d.get("verdicts") else "", section("Spec card", table(rows))]
    if d.get("reference"):
        ref = [{"entry": e["key"], "value": e.get("value")} for e in d["reference"].get("entries", [])]
        tables.append(section(f"Reference card ({d.get('like')})", table(ref)))
    return figs, tables


def params_parts(d: dict) -> tuple[list[str], list[str]]:
    comps = [c for c in d.get("components") or [] if isinstance(c.get("params"), int) and c["params"] > 0]
    figs = []
    if comps:
        figs.append(figure(svg.bar_chart([(c["name"], float(c["params"])) for c in comps], title="parameters per component",
                                         x_label="parameters"), "Parameters of each component, in dataflow order."))
    return figs, [section("Components", table(d.get("components") or []))]


PARTS = {"check": (check_parts, ("checks", "counts")), "depth": (depth_parts, ("layers", "compare")),
         "bench": (bench_parts, ("results",)), "compare": (compare_parts, ("components", "comparisons")),
         "spec": (spec_parts, ("card", "verdicts", "reference")), "params": (params_parts, ("components",))}


def rest(d: dict, used: tuple[str, ...]) -> list[str]:
    """Whatever the command's own parts left out, generically: scalars in one table, lists of rows, nested objects."""
    left = {k: v for k, v in d.items() if k not in FLAT_KEYS + used}
    scalars = {k: v for k, v in left.items() if not isinstance(v, (dict, list))}
    out = [section("Summary", key_values(scalars))] if scalars else []
    for k, v in left.items():
        if _rows(v):
            out.append(section(k.replace("_", " ").capitalize(), table(v)))
        elif isinstance(v, dict) and v:
            out.append(section(k.replace("_", " ").capitalize(), key_values(v)))
        elif isinstance(v, list) and v:
            out.append(section(k.replace("_", " ").capitalize(), f"<p>{escape(cell(v))}</p>"))
    return out


def html_report(d: dict, version: str = "") -> str:
    """The page for one report's dict (what --json prints)."""
    command = str(d.get("command", "report"))
    parts, used = PARTS.get(command, (lambda _: ([], []), ()))
    figs, tables = parts(d)
    env = d.get("environment") or {}
    meta = " \u00b7 ".join(f"{k} {cell(v)}" for k, v in env.items() if not isinstance(v, (dict, list)))
    ok = bool(d.get("ok"))
    body = [f"<header><h1>tblock {escape(command)}: {escape(str(d.get('subject', '')))} "
            f'<span class="verdict {"ok" if ok else "not-ok"}">{"ok" if ok else "not ok"}</span></h1>'
            f'<p class="meta">tblock {escape(version)} \u00b7 {escape(meta)}</p></header>']
    if d.get("warnings"):
        body.append(section("Warnings", "<ul>" + "".join(f"<li>{escape(str(w))}</li>" for w in d["warnings"]) + "</ul>"))
    if d.get("findings"):
        body.append(section("Findings", findings(d["findings"])))
    if figs:
        body.append(section("Figures", f'<div class="figures">{"".join(figs)}</div>'))
    body += tables + rest(d, used)
    body.append(section("Run", "<h3>config</h3>" + key_values(d.get("config") or {}) +
                        "<h3>environment</h3>" + key_values(env)))
    body.append(f"<details><summary>the JSON of this report (tblock {escape(command)} --json)</summary>"
                f"<pre>{escape(dumps(d))}</pre></details>")
    title = f"tblock {command}: {d.get('subject', '')}"
    return ("<!DOCTYPE html>\n"
            f'<html lang="en"><head><meta charset="utf-8"/>{MARK}'
            '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def ensure_html_target(path: str) -> None:
    """Refuse, before measuring, an --html path that cannot be written or holds a file that is not one of our reports."""
    import os

    from tblock_cli.errors import ConfigError
    from tblock_cli.report import ensure_writable

    ensure_writable(path, "--html")
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                head = f.read(HEAD_BYTES)
        except OSError as e:
            raise ConfigError(f"--html {path}: cannot read it: {e.strerror or e}") from None
        if MARK not in head:
            raise ConfigError(f"--html {path}: exists and is not a tblock report; give a new file name or remove it")


def save_html(report, path: str) -> None:
    from tblock_cli import __version__
    from tblock_cli.errors import ConfigError

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html_report(report.to_dict(), __version__))
    except OSError as e:
        raise ConfigError(f"--html {path}: cannot write it: {e.strerror or e}") from None
