"""What a comparison found, as data: each comparison's numbers, findings as (status, kind, facts), the JSON envelope."""

from __future__ import annotations

from dataclasses import dataclass

from tblock_cli.report import Finding, RunInfo, Status, Verdict, jsonable  # noqa: F401 - Finding: compare's kinds too


@dataclass(frozen=True)
class Comparison:
    """One quantity computed by both sides: outputs, outputs under a padding mask, gradients, decoding."""

    name: str  # outputs | padded | causal | input_grad | param_grads | decode | compiled ...
    rel: float  # max |A - B| / max(1, max |A|), in float64
    max_abs: float | None  # None where only the relative difference was kept (--compile)
    tol: float  # the relative tolerance it was judged at (or atol when --atol/--rtol are given)
    equal: bool
    worst: str | None = None  # for parameter gradients: the parameter where they differ most


@dataclass(frozen=True)
class CompareReport(Verdict):
    a: str
    b: str
    comparisons: tuple[Comparison, ...]
    findings: tuple[Finding, ...]
    mapping: dict  # counts by how each pair was found, and the pairs (A label -> B label)
    components: tuple = ()  # ComponentDiff per captured role output, when localised or asked (--dtype-b)
    compile: dict | None = None  # the --compile section: backend, graph_breaks, reasons, recompiles
    run: RunInfo | None = None

    @property
    def ok(self) -> bool:
        """Not failing, and every comparison equal (each is a verdict of its own)."""
        return not self.failing and all(c.equal for c in self.comparisons)

    @property
    def first_difference(self) -> Finding | None:
        return next((f for f in self.findings if f.kind == "compare.first_difference"), None)

    def to_dict(self) -> dict:
        body = {
            "a": self.a, "b": self.b,
            "comparisons": jsonable(self.comparisons),
            "findings": [{"status": f.status.value, "kind": f.kind, "facts": jsonable(f.facts), "text": f.text}
                         for f in self.findings],
            "mapping": jsonable(self.mapping),
            "components": jsonable(self.components),
        }
        if self.compile is not None:
            body["compile"] = jsonable(self.compile)
            body["graph_breaks"] = self.compile.get("graph_breaks")
        return self.run.envelope("compare", self.ok, body) if self.run else {"command": "compare", "ok": self.ok, **body}
