"""Charts as inline SVG text, written by hand: no matplotlib, no scripts, well-formed XML that prints as it shows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 70, 190, 34, 46  # margins: y tick labels, legend, title, x tick labels and axis name
# Colour-blind-safe (Okabe-Ito), dark enough to read on white and on paper.
LEGEND_CHARS = 24  # what fits beside the plot at the legend's font size; a longer name is cut, whole in its tooltip
PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000", "#7f7f7f")


@dataclass(frozen=True)
class Series:
    name: str
    points: tuple[tuple[float, float], ...]
    dashed: bool = False  # a reference curve (theta's frequencies) rather than measured points
    markers: bool = True


def fmt(v: float) -> str:
    """A tick label: short, exact enough to tell ticks apart."""
    if v == 0:
        return "0"
    a = abs(v)
    if 1e4 <= a < 1e9 and v == int(v):  # counts: 16,640 parameters, 4,096 tokens
        return f"{v:,.0f}"
    if a >= 1e5 or a < 1e-3:
        return f"{v:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{v:.4g}"


def short(name: str) -> str:
    return name if len(name) <= LEGEND_CHARS else name[: LEGEND_CHARS - 1] + "\u2026"


def linear_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if step * m >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
    every = max(1, (b - a) // 6)
    decades = [10.0 ** k for k in range(a, b + 1, every) if lo * (1 - 1e-9) <= 10.0 ** k <= hi * (1 + 1e-9)]
    if len(decades) >= 3:
        return decades
    steps = [m * 10.0 ** k for k in range(a - 1, b + 1) for m in (1, 2, 5) if lo * (1 - 1e-9) <= m * 10.0 ** k <= hi * (1 + 1e-9)]
    if len(steps) >= 3:  # a decade or two: 1, 2, 5 of each
        return steps
    return [t for t in linear_ticks(lo, hi) if t > 0] or [lo, hi]  # within a fraction of a decade: round numbers


class Axis:
    """One axis: data values to pixels, linear or logarithmic, padded to round numbers."""

    def __init__(self, values, log: bool, start: float, length: float, flip: bool = False, ticks=None):
        vals = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
        lo, hi = (min(vals), max(vals)) if vals else (1.0, 10.0)
        self.log = log and lo > 0
        if self.log:
            lo, hi = (lo / 2, hi * 2) if lo == hi else (lo, hi)
            self.ticks = ticks or log_ticks(lo, hi)
            lo, hi = min(lo, *self.ticks), max(hi, *self.ticks)
        else:
            if lo == hi:
                lo, hi = lo - (abs(lo) or 1) / 2, hi + (abs(hi) or 1) / 2
            self.ticks = ticks or linear_ticks(lo, hi)
            lo, hi = min(lo, self.ticks[0]), max(hi, self.ticks[-1])
        self.lo, self.hi = (math.log10(lo), math.log10(hi)) if self.log else (lo, hi)
        self.start, self.length, self.flip = start, length, flip

    def __call__(self, v: float) -> float:
        t = ((math.log10(v) if self.log else v) - self.lo) / ((self.hi - self.lo) or 1)
        return self.start + (1 - t if self.flip else t) * self.length


def _svg(title: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> str:
    return (f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}">'
            f"<title>{escape(title)}</title>"
            f'<text class="chart-title" x="{width / 2:.0f}" y="18" text-anchor="middle">{escape(title)}</text>'
            + "".join(body) + "</svg>")


def line_chart(series: list[Series], *, title: str, x_label: str, y_label: str, log_x: bool = False,
               log_y: bool = False, x_ticks: list[float] | None = None, from_zero: bool = False) -> str:
    """Lines with points, a frame, ticks on both axes and a legend at the right; from_zero: a linear y axis starts at 0."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xs = [p[0] for s in series for p in s.points]
    ys = [p[1] for s in series for p in s.points] + ([0.0] if from_zero and not log_y else [])
    x = Axis(xs, log_x, LEFT, plot_w, ticks=x_ticks)
    y = Axis(ys, log_y, TOP, plot_h, flip=True)
    body = [f'<rect class="frame" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>']
    for t in y.ticks:
        body.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(t):.1f}" y2="{y(t):.1f}"/>'
                    f'<text class="tick" x="{LEFT - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    for t in x.ticks:
        body.append(f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" y2="{TOP + plot_h}"/>'
                    f'<text class="tick" x="{x(t):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{fmt(t)}</text>')
    body.append(f'<text class="axis" x="{LEFT + plot_w / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>'
                f'<text class="axis" transform="translate(16 {TOP + plot_h / 2:.0f}) rotate(-90)" text-anchor="middle">'
                f"{escape(y_label)}</text>")
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        pts = [(px, py) for px, py in s.points if math.isfinite(px) and math.isfinite(py)
               and (px > 0 or not x.log) and (py > 0 or not y.log)]
        path = " ".join(f"{x(px):.1f},{y(py):.1f}" for px, py in pts)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        if len(pts) > 1:
            body.append(f'<polyline class="line" points="{path}" stroke="{colour}"{dash}/>')
        if s.markers:
            body += [f'<circle cx="{x(px):.1f}" cy="{y(py):.1f}" r="3" fill="{colour}"><title>{escape(s.name)}: '
                     f"{fmt(px)}, {fmt(py)}</title></circle>" for px, py in pts]
        ly = TOP + 8 + 18 * i
        body.append(f'<line x1="{WIDTH - RIGHT + 12}" x2="{WIDTH - RIGHT + 32}" y1="{ly}" y2="{ly}" stroke="{colour}" '
                    f'stroke-width="2"{dash}/><text class="legend" x="{WIDTH - RIGHT + 38}" y="{ly + 4}">'
                    f"<title>{escape(s.name)}</title>{escape(short(s.name))}</text>")
    return _svg(title, body)


def bar_chart(bars: list[tuple[str, float]], *, title: str, x_label: str, log: bool = False,
              limit: tuple[str, float] | None = None) -> str:
    """Horizontal bars, one per label, with the value at the bar's end; `limit` draws a named vertical line (a tolerance)."""
    row, left = 22, 150
    height = TOP + BOTTOM + row * max(len(bars), 1)
    plot_w = WIDTH - left - 80
    values = [v for _, v in bars] + ([limit[1]] if limit else [])
    x = Axis(values + ([] if log else [0.0]), log, left, plot_w)
    base = float(left) if x.log else x(0.0)
    body = [f'<rect class="frame" x="{left}" y="{TOP}" width="{plot_w}" height="{row * max(len(bars), 1)}"/>']
    bottom = TOP + row * max(len(bars), 1)
    for t in x.ticks:
        body.append(f'<line class="grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" y2="{bottom}"/>'
                    f'<text class="tick" x="{x(t):.1f}" y="{bottom + 16}" text-anchor="middle">{fmt(t)}</text>')
    for i, (label, v) in enumerate(bars):
        top = TOP + row * i + 4
        drawable = math.isfinite(v) and (v > 0 or not x.log)
        end = x(v) if drawable else base
        body.append(f'<text class="tick" x="{left - 6}" y="{top + 11}" text-anchor="end">{escape(label)}</text>'
                    f'<rect class="bar" x="{min(base, end):.1f}" y="{top}" width="{abs(end - base):.1f}" height="{row - 8}">'
                    f"<title>{escape(label)}: {fmt(v)}</title></rect>"
                    f'<text class="tick" x="{max(base, end) + 4:.1f}" y="{top + 11}">{fmt(v)}</text>')
    if limit is not None:
        body.append(f'<line class="limit" x1="{x(limit[1]):.1f}" x2="{x(limit[1]):.1f}" y1="{TOP - 4}" y2="{bottom}"/>'
                    f'<text class="legend" x="{x(limit[1]) + 4:.1f}" y="{TOP - 6}">{escape(limit[0])}</text>')
    body.append(f'<text class="axis" x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">{escape(x_label)}</text>')
    return _svg(title, body, height=height)


def status_strip(counts: list[tuple[str, int]], *, title: str) -> str:
    """One bar split by status (pass, warn, fail, ...), each part as wide as its count, class `s-STATUS`."""
    total = sum(n for _, n in counts) or 1
    width, left, bar_w = WIDTH, 10, WIDTH - 20
    body, at = [], float(left)
    for status, n in counts:
        if not n:
            continue
        w = bar_w * n / total
        body.append(f'<rect class="s-{escape(status)}" x="{at:.1f}" y="30" width="{w:.1f}" height="22">'
                    f"<title>{escape(status)}: {n}</title></rect>")
        if w > 40:
            body.append(f'<text class="strip" x="{at + w / 2:.1f}" y="45" text-anchor="middle">{n} {escape(status)}</text>')
        at += w
    return _svg(title, body, width=width, height=62).replace('class="chart"', 'class="chart strip"', 1)
