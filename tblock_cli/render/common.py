"""What every view shares: the console, width-aware renderables, glyphs (Unicode or ASCII), number formats."""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# Below this many columns a table puts its text columns under the names and keeps every number whole.
NARROW = 96
# Rich's own width when it cannot tell the terminal's; used when COLUMNS says 0 or nonsense.
DEFAULT_WIDTH = 80
# The narrowest layout drawn: a check's name (folded when longer) beside its status.
MIN_WIDTH = 20

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim", "error": "bold magenta"}
FINDING_STYLE = {"info": "", "warn": "yellow", "fail": "bold red"}
FINDING_MARK = {"warn": "!", "fail": "!"}

SPARK = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.-:=+*#"
_TRAILING = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$", re.M)


class PlainConsole(Console):
    """A Console that, writing to a file or a pipe, drops the spaces Rich pads every line with, and
    replaces what the stream's encoding cannot carry instead of raising."""

    def print(self, *objects, **kwargs) -> None:
        if self.is_terminal:
            super().print(*objects, **kwargs)
            return
        with self.capture() as captured:
            super().print(*objects, **kwargs)
        text = _TRAILING.sub(r"\1", captured.get())
        if not self.encoding.startswith("utf"):
            text = text.encode(self.encoding, "replace").decode(self.encoding)
        self.file.write(text)
        self.file.flush()


class PlainTable(Table):
    """A Table whose string cells and title are plain text, never markup: a check's detail, a path or an error carries
    foreign text (every gloo error starts with `[/path/...]`, which Rich would read as a closing tag and raise on)."""

    def __init__(self, *columns, title=None, **kw):
        super().__init__(*columns, title=Text(title) if isinstance(title, str) else title, **kw)

    def add_row(self, *cells, **kw):
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)


def make_console(stderr: bool = False) -> PlainConsole:
    """The console a command prints to; COLUMNS=0 (or garbage) falls back to the terminal's width or 80."""
    console = PlainConsole(stderr=stderr)
    if console.width < 1:
        console.width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns or DEFAULT_WIDTH
    if console.width < MIN_WIDTH:
        console.width = MIN_WIDTH
    return console


@dataclass(frozen=True)
class Fit:
    """What a view can use where it is drawn: a narrow layout, and Unicode or only ASCII glyphs."""

    narrow: bool = False
    ascii: bool = False

    def bar(self, n: int) -> str:
        return ("#" if self.ascii else "█") * n

    def sparkline(self, values: list[float], top: float | None = None) -> str:
        return sparkline(values, top, SPARK_ASCII if self.ascii else SPARK)


class ByWidth:
    """A renderable that builds itself for where it is drawn: build(Fit(narrow, ascii)) -> renderable."""

    def __init__(self, build, threshold: int = NARROW):
        self.build, self.threshold = build, threshold

    def __rich_console__(self, console, options):
        yield self.build(Fit(options.max_width < self.threshold, options.ascii_only))


def table_for(narrow: bool, **kw) -> Table:
    """SIMPLE_HEAVY, left title; narrow: no edge padding and one space between columns."""
    return PlainTable(box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False, collapse_padding=narrow,
                 padding=(0, 1) if not narrow else (0, 0, 0, 1), **kw)


def sparkline(values: list[float], top: float | None = None, glyphs: str = SPARK) -> str:
    """Heights from zero to the largest value (or to `top`, to share a scale), so equal values look equal."""
    hi = max(max(values), 0.0) if top is None else top
    if hi <= 0:
        return glyphs[0] * len(values)
    return "".join(glyphs[max(0, min(7, round(v / hi * 8) - 1))] for v in values)


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


def finding_line(f, indent: str = "") -> Text:
    status = getattr(f.status, "value", f.status)
    return Text(f"{indent}{FINDING_MARK.get(status, '-')} {f.text}", style=FINDING_STYLE.get(status, ""))


def environment_line(env: dict) -> str:
    return f"torch {env['torch']}, {env['device']}, {env['dtype']}, {plural(env['threads'], 'thread')}"
