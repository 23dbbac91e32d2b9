"""The package's shape and the tests': no module over 400 lines, no import circle (lazy imports included), a package
root of at most 12 modules, the engine and the checks apart, tests named after what they test."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "tblock_cli"
TESTS = Path(__file__).parent
MAX_LINES = 400
# The package root holds the front door and the ground floor; every subsystem has a room (a subpackage) of its own.
MAX_ROOT_MODULES = 12


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every tblock_cli module this one imports, at any depth of the file (lazy imports count)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def test_no_module_is_over_400_lines():
    files = [*PACKAGE.rglob("*.py"), *TESTS.glob("*.py")]
    long = {str(p): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_package_root_is_not_a_drawer():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_tests_are_named_after_what_they_test():
    """A module of the package, a command, or a property: never the work that wrote it (test_checks3: a generation)."""
    import re

    named = [p.name for p in TESTS.glob("*.py") if re.search(r"\d\.py$|_(round|issue|gen|generation)\d*\b", p.name)]
    assert not named, named


def test_tests_import_no_circle():
    """The test helpers (the zoo's modules, conftest) import one another without a circle."""
    local = {p.stem: p for p in TESTS.glob("*.py")}
    graph = {}
    for name, path in local.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module or "")
        graph[name] = {m for m in found if m in local and m != name}
    _assert_no_circle(graph)


def test_no_import_circle():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    # a package's __init__ re-exporting its own modules is not a circle of design
    graph = {m: {d for d in deps if not m.startswith(d + ".") and not d.startswith(m + ".")} for m, deps in graph.items()}
    _assert_no_circle(graph)


def _assert_no_circle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_engine_and_the_checks_import_nothing_of_each_other():
    """distributed/ runs rank passes and returns facts; the tensor_parallel and fsdp verdicts are checks'. Neither
    package imports the other (lazy imports included): a check reaches the engine through the Sharding it is handed."""
    mods = modules()
    for a, b in (("tblock_cli.checks", "tblock_cli.distributed"), ("tblock_cli.distributed", "tblock_cli.checks")):
        crossing = {m: sorted(d for d in imports(m, p, set(mods)) if d == b or d.startswith(b + "."))
                    for m, p in mods.items() if m == a or m.startswith(a + ".")}
        assert not any(crossing.values()), {m: d for m, d in crossing.items() if d}


def test_tolerances_live_on_the_ground_floor():
    """TOLERANCE is shared by checks, compare and the distributed engine: it lives in probes (the base layer)."""
    import tblock_cli.probes

    assert "TOLERANCE = {" in Path(tblock_cli.probes.__file__).read_text()
    for path in PACKAGE.rglob("*.py"):
        assert "from tblock_cli.checks.context import TOLERANCE" not in path.read_text(), path


def test_checks_never_write_the_context():
    """Shared probes are declared once (checks/context.py PROBES) and memoised by Context.probe; a check reads them and
    never assigns to the context (the runner alone keeps its bookkeeping: current, met, unmet)."""
    writes = []
    for path in (PACKAGE / "checks").glob("*.py"):
        if path.name in ("context.py", "battery.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            writes += [f"{path.name}:{node.lineno}" for t in targets
                       if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "ctx"]
    assert not writes, writes


def test_the_wheel_takes_every_subpackage():
    """`pip install .` (not -e) installs what setuptools finds: a package list of the root alone left out checks/,
    subject/ and the rest, and the installed command failed on its first import."""
    import fnmatch

    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")]
    missing = [p for p in packages if not any(fnmatch.fnmatch(p, pattern) for pattern in include)]
    assert len(packages) > 5 and not missing, missing
