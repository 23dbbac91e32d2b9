"""The check battery: `battery` (registry and runner), `context` (what checks share), `result` (outcomes as data),
and the checks grouped by what they probe: `forward`, `gradients`, `mixing`, `attention`, `structure`."""

from tblock_cli.checks.battery import CHECK_NAMES, REGISTRY, run_checks
from tblock_cli.checks.result import CheckReport, CheckResult
from tblock_cli.report import Status

__all__ = ["CHECK_NAMES", "REGISTRY", "CheckReport", "CheckResult", "Status", "run_checks"]
