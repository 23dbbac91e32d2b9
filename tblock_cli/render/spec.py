"""The `spec` view: the card (entry, value, how it was read), and each declared entry's verdict."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from tblock_cli.messages import text
from tblock_cli.messages.spec import shown

VERDICT = {"match": ("as declared", "green"), "differs": ("DIFFERS", "bold red"), "unread": ("unread", "dim")}


def spec_view(report) -> Group:
    verdicts = {v.key: v for v in report.verdicts}
    table = Table(title=f"tblock spec: {report.run.subject if report.run else report.card.subject}",
                  box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("entry", no_wrap=True)
    table.add_column("value", overflow="fold", ratio=1)
    if verdicts:
        table.add_column("declared", overflow="fold", ratio=1)
    table.add_column("how it was read", overflow="fold", ratio=2)
    for e in report.card.entries:
        if not e.read and e.key not in verdicts:
            continue  # unread and undeclared: listed once below, not a row of dashes
        value = Text(shown(e.value)) if e.read else Text(f"- ({e.skip})", style="dim")
        row = [e.key, value]
        if verdicts:
            v = verdicts.get(e.key)
            row.append(Text("") if v is None else Text(f"{shown(v.claimed)}: {VERDICT[v.status][0]}", style=VERDICT[v.status][1]))
        row.append(Text(e.how, style="dim"))
        table.add_row(*row)
    parts: list = [table]
    unread = [e.key for e in report.card.entries if not e.read and e.key not in verdicts]
    if unread:
        parts.append(Text(f"not read for this block: {', '.join(unread)} (--json says why, entry by entry)", style="dim"))
    for f in report.findings:
        parts.append(Text(("! " if f.status.value == "fail" else "  ") + text(f.kind, f.facts),
                          style="bold red" if f.status.value == "fail" else ""))
    if report.verdicts:
        counts = {s: sum(v.status == s for v in report.verdicts) for s in VERDICT}
        summary = f"{counts['match']} as declared, {counts['differs']} differ, {counts['unread']} unread"
        parts.append(Text(("OK: " if report.ok else "DIFFERS: ") + summary, style="green" if report.ok else "bold red"))
    return Group(*parts)
