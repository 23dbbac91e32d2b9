"""`check --json` over the whole zoo, saved, or compared with a saved copy: a refactor must change nothing but added keys.

    python scripts/zoo_json.py --save before.json       # every zoo block and the built-in variants
    python scripts/zoo_json.py --against before.json    # exit 1 on any key removed or value changed
    python scripts/zoo_json.py --against before.json --verdicts  # only each check's status and kind

--verdicts is for a change that draws random inputs in another order or runs fewer forwards: values move within
tolerance, what each check decides must not.

The environment block (torch version, threads) and wall-clock fields are left out: they are not the checks'.
Added keys (new fields on a check result or a finding) and added checks are allowed; a removed key or check, or a
changed value, is listed. Counts are derived from the checks and not compared apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import tblock_cli  # noqa: E402

import zoo  # noqa: E402

SIZE = {"d_model": 32, "n_heads": 4, "threads": 1}
VOLATILE = {"environment", "seconds", "timing"}


def blocks() -> dict[str, tuple[str | None, dict]]:
    """name -> (SPEC or None for the built-in block, flags)."""
    spec = lambda name: f"{TESTS / 'zoo.py'}:{name}"  # noqa: E731
    out: dict[str, tuple[str | None, dict]] = {
        "builtin-pre": (None, {}), "builtin-post": (None, {"norm": "post"}), "builtin-causal": (None, {"causal": True}),
        "builtin-stack": (None, {"layers": 2}),
    }
    for name, flags in zoo.CORRECT.items():
        out[name] = (spec(name), flags)
    for table in (zoo.PLANTED, zoo.PLANTED_2):
        for name, (_check, flags) in table.items():
            out[name] = (spec(name), flags)
    for name in zoo.WARNED:
        out[name] = (spec(name), {})
    for name in list(zoo.CACHE_BUGS) + list(zoo.CACHED_CORRECT):
        out[name] = (spec(name), {"causal": True})
    return out


def run_all() -> dict:
    results = {}
    for name, (spec, flags) in blocks().items():
        torch.manual_seed(0)
        try:
            results[name] = tblock_cli.check(spec, **{**SIZE, **flags}).to_dict()
        except tblock_cli.errors.TBlockError as e:  # a load error is part of the picture too
            results[name] = {"error": str(e)}
    return strip(results)


def strip(obj):
    """Without volatile keys, and with the zoo's path cut to its file name: a run from another checkout compares."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    if isinstance(obj, str) and "zoo.py:" in obj:
        return "zoo.py:" + obj.split("zoo.py:", 1)[1]
    return obj


def differences(old, new, path: str = "") -> list[str]:
    """Keys of `old` missing from `new`, or values that differ; keys only in `new` are additions and allowed."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k, v in old.items():
            if k == "counts":  # derived from the checks, which are compared one by one
                continue
            if k not in new:
                out.append(f"{path}/{k}: removed")
            else:
                out.extend(differences(v, new[k], f"{path}/{k}"))
        return out
    if isinstance(old, list) and isinstance(new, list) and all(isinstance(x, dict) and "name" in x for x in old + new):
        # check results by name: a check added since is an addition, one removed or changed is a difference
        return differences({x["name"]: x for x in old}, {x["name"]: x for x in new}, path)
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} items -> {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def verdicts(runs: dict) -> dict:
    """Per run, each check's status and kind (or the run's load error)."""
    return {name: run if "error" in run else {c["name"]: [c["status"], c["kind"]] for c in run["checks"]}
            for name, run in runs.items()}


def main() -> int:
    import tblock_cli.errors  # noqa: F401 - for the except clause above

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", metavar="FILE")
    group.add_argument("--against", metavar="FILE")
    parser.add_argument("--verdicts", action="store_true", help="with --against: compare statuses and kinds only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now = run_all()
    if args.save:
        Path(args.save).write_text(json.dumps(now, indent=1, sort_keys=True))
        print(f"saved {len(now)} check runs to {args.save}")
        return 0
    old = strip(json.loads(Path(args.against).read_text()))
    diffs = differences(verdicts(old), verdicts(now)) if args.verdicts else differences(old, now)
    for d in diffs:
        print(d)
    print(f"{len(now)} check runs compared: {len(diffs)} difference(s) beyond added keys")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
