"""A check report as JUnit XML, the format CI systems display: one testcase per check."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tblock_cli.report import Status


def junit_tree(report) -> ET.ElementTree:
    """fail -> failure, error -> error, skip -> skipped; warn -> failure under strict, else a property of its case."""
    counts = report.counts()
    failures = counts["fail"] + (counts["warn"] if report.strict else 0)
    seconds = sum(c.seconds or 0.0 for c in report.checks)
    subject = report.run.subject if report.run else "block"
    totals = {"tests": str(len(report.checks)), "failures": str(failures), "errors": str(counts["error"]),
              "skipped": str(counts["skip"]), "time": f"{seconds:.4f}"}
    root = ET.Element("testsuites", name="tblock check", **totals)
    suite = ET.SubElement(root, "testsuite", name=f"tblock check {subject}", **totals)
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="subject", value=subject)
    ET.SubElement(props, "property", name="strict", value=str(report.strict).lower())
    for status, n in counts.items():
        ET.SubElement(props, "property", name=f"count.{status}", value=str(n))
    for c in report.checks:
        case = ET.SubElement(suite, "testcase", classname="tblock.check", name=c.name, time=f"{c.seconds or 0.0:.4f}")
        message = f"{c.status.value}: {c.detail}"
        if c.status is Status.FAIL or (c.status is Status.WARN and report.strict):
            ET.SubElement(case, "failure", message=message, type=c.kind or c.status.value).text = c.detail
        elif c.status is Status.ERROR:
            ET.SubElement(case, "error", message=message, type=c.kind or "error").text = c.detail
        elif c.status is Status.SKIP:
            ET.SubElement(case, "skipped", message=c.detail)
        elif c.status is Status.WARN:
            case_props = ET.SubElement(case, "properties")
            ET.SubElement(case_props, "property", name="warning", value=c.detail)
            ET.SubElement(case_props, "property", name="kind", value=c.kind)
    ET.indent(root)
    return ET.ElementTree(root)


# What every report write_junit makes starts with (after the XML declaration): how an existing file is known as ours.
OURS = '<testsuites name="tblock check"'


def ensure_junit_target(path: str) -> None:
    """Refuse, before checking, a --junit-xml path that cannot be written or that holds something other than a JUnit
    report of tblock's (as bench --save does for a saved run): an existing file is only replaced when it is ours, or
    empty (nothing to lose)."""
    import os

    from tblock_cli.errors import ConfigError
    from tblock_cli.report import ensure_writable

    if not isinstance(path, str) or not path.strip():
        raise ConfigError("--junit-xml needs a file name")
    ensure_writable(path, "--junit-xml")
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        head = ""
    if OURS not in head:
        raise ConfigError(f"--junit-xml {path}: the file exists and is not a tblock JUnit report; refusing to overwrite "
                          f"it (give a new file name, or remove it first)")


def write_junit(report, path: str) -> None:
    from tblock_cli.errors import ConfigError

    try:
        junit_tree(report).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as e:
        raise ConfigError(f"--junit-xml {path}: cannot write it: {e.strerror or e}") from None
