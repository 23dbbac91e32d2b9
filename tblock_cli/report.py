"""The words every report shares: the status vocabulary, a finding, and the one JSON envelope."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field

# Bumped when a key is renamed, removed or changes type; new keys do not bump it.
SCHEMA_VERSION = 1


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"
    INFO = "info"


@dataclass(frozen=True)
class Finding:
    """One observation a command draws from its numbers, as data: `kind` (a stable dotted name such as
    `depth.mixed_placement`) and `facts` (the numbers behind it); `messages` writes its sentence.

    info states a number; warn fails under --strict; fail makes the command exit 1 (a --compare regression).
    """

    status: Status
    kind: str
    facts: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        from tblock_cli.messages import text

        return text(self.kind, self.facts)

    def to_dict(self) -> dict:
        return {"status": self.status.value, "text": self.text, "kind": self.kind, "facts": jsonable(self.facts)}


def failing_of(findings, strict: bool = False) -> tuple:
    """The findings that make a report not ok: fail and error, and warn under strict."""
    bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if strict else set())
    return tuple(f for f in findings if f.status in bad)


class Verdict:
    """The protocol every command's report follows, written once: `findings` (each with status, kind, facts, text;
    a check report's are its check results), `failing` (what makes it not ok: fail and error, and warn where the
    report is `strict`) and `ok`. A report supplies `findings` (and `strict` where it has one)."""

    @property
    def failing(self) -> tuple:
        return failing_of(self.findings, getattr(self, "strict", False))

    @property
    def ok(self) -> bool:
        return not self.failing


def jsonable(obj):
    """Dataclasses, enums, tuples and non-finite floats turned into plain JSON values."""
    if isinstance(obj, Finding):
        return obj.to_dict()
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


def envelope(command: str, ok: bool, subject: str, config: dict, environment: dict, body: dict,
             warnings: tuple[str, ...] = ()) -> dict:
    """Every command's --json: the same six keys first, then the command's own."""
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "ok": ok,
        "subject": subject,
        "config": jsonable(config),
        "environment": jsonable(environment),
        "warnings": list(warnings),
        **jsonable(body),
    }


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2)


def ensure_writable(path: str, flag: str) -> None:
    """Refuse, before any measuring, an output path that cannot be written (a folder, no such folder, no permission)."""
    import os

    from tblock_cli.errors import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: folder {os.path.dirname(path) or '.'} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there: {e.strerror or e}") from None
    if not existed:
        os.remove(path)


@dataclass(frozen=True)
class RunInfo:
    """What was run, where: the envelope's subject, config, environment and warnings."""

    subject: str
    config: dict
    environment: dict
    warnings: tuple[str, ...] = ()

    def envelope(self, command: str, ok: bool, body: dict) -> dict:
        return envelope(command, ok, self.subject, self.config, self.environment, body, self.warnings)


def read_json(path: str, flag: str, expected: str):
    """A JSON file the user named, parsed; or one ConfigError line saying why not and what it should hold."""
    import json

    from tblock_cli.errors import ConfigError

    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{flag} {path}: not JSON; give {expected}") from None
    except RecursionError:
        raise ConfigError(f"{flag} {path}: nested too deeply to be {expected}") from None
