"""What `tblock spec` returns: the card, the reference's card where --like named one, and each claim's verdict."""

from __future__ import annotations

from dataclasses import dataclass

from tblock_cli.card.entries import Card, Verdict
from tblock_cli.report import Finding, RunInfo, Status


@dataclass(frozen=True)
class SpecReport:
    card: Card
    verdicts: tuple[Verdict, ...] = ()
    reference: Card | None = None  # the --like layer's card, read the same way
    like: str | None = None
    run: RunInfo | None = None

    @property
    def differs(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.status == "differs")

    @property
    def ok(self) -> bool:
        return not self.differs

    @property
    def findings(self) -> tuple[Finding, ...]:
        """A finding per claim that differs (fail) or could not be read (info), and per reader that slipped."""
        out = [Finding(Status.FAIL if v.status == "differs" else Status.INFO, f"spec.{v.status}", v.to_dict())
               for v in self.verdicts if v.status != "match"]
        out += [Finding(Status.INFO, "spec.slip", {"slip": s}) for s in self.card.slips]
        return tuple(out)

    @property
    def failing(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status is Status.FAIL)

    def to_dict(self) -> dict:
        run = self.run or RunInfo(self.card.subject, {}, {})
        body = {"card": self.card.to_dict(), "like": self.like,
                "verdicts": [v.to_dict() for v in self.verdicts],
                "counts": {s: sum(v.status == s for v in self.verdicts) for s in ("match", "differs", "unread")},
                "findings": [f.to_dict() for f in self.findings]}
        if self.reference is not None:
            body["reference"] = self.reference.to_dict()
        return run.envelope("spec", self.ok, body)
