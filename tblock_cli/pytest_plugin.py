"""The pytest plugin: one test item per check of the battery, from a three-line test file or `pytest --tblock SPEC`.

    from tblock_cli.pytest_plugin import check_items
    from my_block import MyBlock
    test_my_block = check_items(MyBlock, d_model=64, n_heads=4)   # test_my_block[shape], [padding], ...

pytest loads this module in every run of everyone who installed tblock, so importing it imports neither torch nor
the battery: they load when a tblock test is collected. One battery runs per block and process, limited to the
checks the run selected (`-k`) and the checks whose verdicts those wait for; its report is shared by the items.
"""

from __future__ import annotations

import json
import sys
import warnings

import pytest

MARKER = "tblock"
FIXTURE = "tblock_check"
# The API's own options that are not block flags: what `pytest --tblock` offers besides the shared flags.
SWITCHES = {"strict": "Warnings fail.", "fast": "Leave out the slow checks (kv_cache, dtype, dropout and the training-time checks)."}
TEXTS = {"only": "Run only these checks (comma-separated names).", "skip": "Leave out these checks (comma-separated names).",
         "like": "What the block claims to be: hf:TYPE.", "like_kwargs": "The --tblock-like layer's config overrides, as JSON."}
_REPORTS = pytest.StashKey[dict]()


class TBlockWarning(UserWarning):
    """A check that warns: the item passes (it fails with strict=True) and the sentence shows in pytest's summary."""


def check_items(block=None, **options):
    """A test function that pytest collects as one item per check: `test_x = check_items(MyBlock, d_model=64)`.

    block: an nn.Module class or factory (built once per run), a SPEC string (file.py:NAME, package.module:NAME,
    hf:TYPE) or None (the built-in block); options: tblock_cli.check's (d_model, causal, like, expect, only, strict, ...).
    """
    strict = bool(options.get("strict"))

    @pytest.mark.tblock.with_args(block, **options)
    def test_block(tblock_check):
        verdict(tblock_check, strict=strict)

    # pytest places an item (its skips, --junit-xml's file and line) where its function's code is: the caller's line
    caller = sys._getframe(1).f_code, sys._getframe(1).f_lineno
    test_block.__code__ = test_block.__code__.replace(co_filename=caller[0].co_filename, co_firstlineno=caller[1])
    return test_block


def verdict(result, *, strict: bool = False) -> None:
    """One check result as a pytest outcome: fail and error fail with tblock's sentence and facts, skip skips with its
    reason, warn passes with a TBlockWarning (fails under strict), pass passes."""
    status = result.status.value
    if status == "skip":  # reported at the test's own line, as a skip marker is
        raise pytest.skip.Exception(f"{result.name}: {result.detail}", _use_item_location=True)
    if status in ("fail", "error") or (status == "warn" and strict):
        pytest.fail(explain(result), pytrace=False)
    if status == "warn":
        warnings.warn(TBlockWarning(f"{result.name}: {result.detail}"), stacklevel=2)


def explain(result) -> str:
    """The failure report of one check: its sentence first, then what it measured."""
    lines = [f"tblock {result.name}: {result.status.value}: {result.detail}", f"  kind: {result.kind}"]
    if result.value is not None:
        lines.append(f"  value: {result.value}")
    if result.facts:
        lines.append(f"  facts: {json.dumps(result.facts, default=str)}")
    return "\n".join(lines)


def planned(options: dict) -> tuple[str, ...]:
    """The checks a block's items are made of: the battery's, less what only / skip / fast leave out."""
    from tblock_cli.checks.battery import CHECK_NAMES, select

    chosen = select(options.get("only"), options.get("skip"), bool(options.get("fast")))
    return CHECK_NAMES if chosen is None else chosen


def with_needs(names, allowed) -> tuple[str, ...]:
    """`names` and every check, among `allowed`, whose verdict one of them waits for: running these gives each named
    check the verdict it gets in the whole battery (a check whose need failed skips)."""
    from tblock_cli.checks.battery import REGISTRY

    by_need = {c.establishes: c.name for c in REGISTRY if c.establishes}
    needs = {c.name: c.needs for c in REGISTRY}
    out, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n in out or n not in allowed:
            continue
        out.add(n)
        todo += [by_need[need] for need in needs[n] if need in by_need]
    return tuple(n for n in allowed if n in out)


def _plan_of(item) -> tuple[object, str] | None:
    """(the block's key, the check's name) of a tblock item, None for any other item."""
    if isinstance(item, CheckItem):
        return item.key, item.check
    params = getattr(getattr(item, "callspec", None), "params", {})
    if FIXTURE in params and item.get_closest_marker(MARKER) is not None:
        return item.nodeid.partition("[")[0], params[FIXTURE]
    return None


def report_for(session, key, block, options: dict, check: str):
    """The block's check report, run at the first item that asks (per process) and kept for the others; a block that
    cannot be built is raised again at each of its items."""
    cache = session.config.stash.setdefault(_REPORTS, {})
    if key not in cache:
        allowed = planned(options)
        plans = [_plan_of(item) for item in session.items]
        wanted = {plan[1] for plan in plans if plan is not None and plan[0] == key}
        if check not in wanted:  # an item run outside the session's list: the whole selection
            wanted = set(allowed)
        chosen = {k: v for k, v in options.items() if k not in ("only", "skip", "fast")}
        from tblock_cli import api

        try:
            cache[key] = api.check(block, only=list(with_needs(wanted, allowed)), **chosen)
        except Exception as e:  # noqa: BLE001 - kept, and raised again for each of the block's items
            cache[key] = e
    found = cache[key]
    if isinstance(found, BaseException):
        from tblock_cli.errors import TBlockError

        if isinstance(found, TBlockError):
            pytest.fail(f"tblock could not check {block!r}: {found}", pytrace=False)
        raise found
    return next(c for c in found.checks if c.name == check)


def _marked(node) -> tuple[object, dict]:
    mark = node.get_closest_marker(MARKER)
    if len(mark.args) > 1:
        raise pytest.UsageError(f"@pytest.mark.{MARKER} takes one block and keyword options, got {mark.args!r}")
    block = mark.args[0] if mark.args else mark.kwargs.get("block")
    return block, {k: v for k, v in mark.kwargs.items() if k != "block"}


@pytest.fixture
def tblock_check(request):
    """The CheckResult of one check of the block named by the test's @pytest.mark.tblock(block, **options)."""
    block, options = _marked(request.node)
    return report_for(request.session, request.node.nodeid.partition("[")[0], block, options, request.param)


def pytest_generate_tests(metafunc):
    if FIXTURE not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker(MARKER) is None:
        raise pytest.UsageError(f"{metafunc.definition.nodeid} uses {FIXTURE}: mark it @pytest.mark.{MARKER}(block, **options)")
    names = planned(_marked(metafunc.definition)[1])
    metafunc.parametrize(FIXTURE, names, ids=names, indirect=True)


class CheckItem(pytest.Item):
    """One check of a block named with `pytest --tblock SPEC`; its node id reads tblock::SPEC[check]."""

    def __init__(self, *, spec: str, check: str, options: dict, **kwargs):
        super().__init__(**kwargs)
        self.spec, self.check, self.options = spec, check, options
        self.key = ("--tblock", spec)
        self.add_marker(MARKER)  # -m tblock and -k tblock select these as they do check_items' items

    def runtest(self):
        block = None if self.spec in ("builtin", "built-in") else self.spec
        verdict(report_for(self.session, self.key, block, self.options, self.check), strict=bool(self.options.get("strict")))

    def reportinfo(self):
        # a line number, even with no test file: a skip reported at the item's location needs one
        return self.path, 0, f"tblock {self.spec} [{self.check}]"


def _option_names() -> dict[str, tuple[type, str]]:
    """--tblock-NAME options: the shared block flags `check` takes (declared once, on BlockConfig), then check's own."""
    from tblock_cli.config import FLAGS, SOURCE_FLAGS

    out = {n: (f.type, f.help) for n, f in {**FLAGS, **SOURCE_FLAGS}.items() if n != "block" and "check" in f.commands}
    out.update({n: (bool, h) for n, h in SWITCHES.items()})
    out.update({n: (str, h) for n, h in TEXTS.items()})
    return out


def pytest_addoption(parser):
    group = parser.getgroup("tblock", "tblock: one test item per check of a Transformer block")
    group.addoption("--tblock", action="append", default=[], metavar="SPEC",
                    help="Check this block (path/to/file.py:NAME, package.module:NAME, hf:TYPE or builtin) as one test "
                         "item per check, with the --tblock-* options; repeatable.")
    for name, (kind, text) in _option_names().items():
        option, dest = "--tblock-" + name.replace("_", "-"), "tblock_" + name
        if kind is bool:
            group.addoption(option, action="store_const", const=True, default=None, dest=dest, help=text)
            group.addoption("--tblock-no-" + name.replace("_", "-"), action="store_const", const=False, dest=dest,
                            help=f"Switch {option} off.")
        else:
            group.addoption(option, type=kind, default=None, dest=dest, metavar=name.upper(), help=text)
    group.addoption("--tblock-expect", action="append", default=None, dest="tblock_expect", metavar="KEY=VALUE",
                    help="A spec card entry the block must have (repeatable), as tblock check --expect.")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(block=None, **options): one item per check of the block (needs the "
                                       f"{FIXTURE} fixture); options as tblock_cli.check's")


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(session, config, items):
    specs = config.getoption("tblock", None) or []
    if not specs:
        return
    options = {n: v for n in [*_option_names(), "expect"] if (v := config.getoption("tblock_" + n, None)) is not None}
    added = [CheckItem.from_parent(session, name=f"{spec}[{check}]", nodeid=f"tblock::{spec}[{check}]", spec=spec,
                                   check=check, options=options) for spec in specs for check in planned(options)]
    items.extend(added)
    # as a collector would report them, so "collected N items" counts them
    config.hook.pytest_collectreport(report=pytest.CollectReport("tblock", "passed", None, added))
