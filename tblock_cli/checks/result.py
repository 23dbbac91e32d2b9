"""What a check says: an outcome as data (status, kind, value, facts), the result the runner stamps, the report."""

from __future__ import annotations

from dataclasses import dataclass, field

from tblock_cli.report import RunInfo, Status, failing_of


@dataclass(frozen=True)
class Outcome:
    """What a check function returns: the facts behind its verdict; the words come from `messages`."""

    status: Status
    kind: str  # a stable dotted name, e.g. residual.missing, attention.unscaled
    value: object = None  # a number, a short string, or None: the table's value column
    facts: dict = field(default_factory=dict)  # the numbers behind the verdict, JSON-ready
    unmet: bool | None = None  # whether the need this check establishes is left unmet; None: when it fails or errors


def passed(kind: str, value=None, **facts) -> Outcome:
    return Outcome(Status.PASS, kind, value, facts)


def warned(kind: str, value=None, **facts) -> Outcome:
    return Outcome(Status.WARN, kind, value, facts)


def failed(kind: str, value=None, **facts) -> Outcome:
    return Outcome(Status.FAIL, kind, value, facts)


def skipped(kind: str, **facts) -> Outcome:
    return Outcome(Status.SKIP, kind, None, facts)


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    value: object  # a number, a short string, or None
    kind: str = ""
    facts: dict = field(default_factory=dict)
    seconds: float | None = None  # wall time the check took
    passes: object = None  # cost.Passes: forwards and backwards over the block while it ran (the skipped: none)

    @property
    def detail(self) -> str:
        """One line: what the value means, written from kind and facts."""
        from tblock_cli.messages import text

        return text(self.kind, self.facts)

    @property
    def text(self) -> str:
        """The sentence, under the name every finding uses for it."""
        return self.detail

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "value": self.value, "detail": self.detail, "kind": self.kind,
                "facts": self.facts, **({} if self.seconds is None else {"seconds": self.seconds}),
                **({} if self.passes is None else {"passes": self.passes.to_dict()})}


@dataclass(frozen=True)
class CheckReport:
    checks: tuple[CheckResult, ...]
    strict: bool
    run: RunInfo | None = None
    seconds: float | None = None  # wall time of the whole battery (the checks' own seconds and what they share)
    passes: object = None  # cost.Passes of the whole battery

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def findings(self) -> tuple[CheckResult, ...]:
        """What every report calls its findings (status, kind, facts, text): here, the check results."""
        return self.checks

    @property
    def failing(self) -> tuple[CheckResult, ...]:
        return failing_of(self.checks, self.strict)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status == s for c in self.checks) for s in Status if s is not Status.INFO}

    def to_dict(self) -> dict:
        run = self.run or RunInfo("", {}, {})
        return run.envelope("check", self.ok, {"strict": self.strict, "counts": self.counts(),
                                               **({} if self.seconds is None else {"seconds": self.seconds}),
                                               **({} if self.passes is None else {"passes": self.passes.to_dict()}),
                                               "checks": [c.to_dict() for c in self.checks]})
