"""Every transformers model type AutoConfig.for_model builds, checked as `--block hf:TYPE` at d_model 64.

Types run in subprocesses (one each by default, `--per-process N` to share the start-up) under a per-type alarm,
so one hang or crash cannot stop the sweep. Prints a Markdown table (type, driven, statuses, seconds); `--out FILE`
also keeps one JSON line per type. Slow (minutes per hundred types at one thread): kept out of the test suite.

    python scripts/hf_sweep.py --popular --per-process 8 --out /tmp/hf_sweep.jsonl  # the popular families
    python scripts/hf_sweep.py --out /tmp/hf_sweep.jsonl            # every buildable type (hours)
    python scripts/hf_sweep.py --types llama t5 vit --timeout 120   # a few
    python scripts/hf_sweep.py --only norms,relative --per-process 16  # two checks over every buildable type
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, signal, sys, time
import tblock_cli
from tblock_cli.errors import TBlockError

class TimedOut(BaseException):
    pass

def alarm(*_):
    raise TimedOut()

signal.signal(signal.SIGALRM, alarm)
timeout, only = int(sys.argv[1]), (sys.argv[2].split(",") if sys.argv[2] != "-" else None)
for t in sys.argv[3:]:
    t0 = time.time()
    signal.alarm(timeout)
    try:
        r = tblock_cli.check("hf:" + t, d_model=64, n_heads=4, d_ff=256, threads=1, only=only)
        row = {"driven": True, "statuses": {c.name: c.status.value for c in r.checks},
               "notes": {c.name: c.detail for c in r.checks if c.status.value in ("warn", "fail", "error")},
               "warnings": list(r.run.warnings) if r.run else []}
    except TBlockError as e:
        row = {"driven": False, "error": str(e)}
    except TimedOut:
        row = {"driven": False, "error": f"timed out after {timeout} s"}
    finally:
        signal.alarm(0)
    row["seconds"] = round(time.time() - t0, 1)
    print("ROW " + json.dumps({"type": t, **row}), flush=True)
"""

# Popular families of every kind: decoders, encoders, encoder-decoders, vision, mixture-of-experts, hybrids.
POPULAR = """gpt2 gptj gpt_neo gpt_neox gpt_bigcode codegen bloom mpt falcon opt xglm ctrl llama mistral mixtral qwen2 qwen2_moe
qwen3 qwen3_moe qwen3_next gemma gemma2 gemma3_text phi phi3 phimoe stablelm starcoder2 olmo olmo2 olmoe cohere cohere2
granite granitemoe deepseek_v2 deepseek_v3 doge minimax jamba falcon_h1 mamba mamba2 bitnet exaone4 glm glm4 helium
hunyuan_v1_dense internlm3 smollm3 ernie4_5 seed_oss arcee apertus nemotron persimmon biogpt
bert roberta xlm-roberta distilbert albert electra deberta deberta-v2 modernbert camembert mpnet nystromformer
ernie megatron-bert funnel xlm t5 mt5 umt5 bart mbart pegasus marian whisper m2m_100 led prophetnet
vit deit dinov2 beit swin clip siglip""".split()


def buildable_types() -> list[str]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    out = []
    for t in sorted(MODEL_MAPPING_NAMES):
        try:
            transformers.AutoConfig.for_model(t)
        except Exception:  # noqa: BLE001 - a config that cannot be built offline is not in the sweep
            continue
        out.append(t)
    return out


def run_group(types: list[str], timeout: float, only: str | None = None) -> list[dict]:
    """One subprocess checks these types in turn (each under its own alarm); a type whose row never comes (the
    process crashed or hung past every alarm) is reported with the last line of the process's stderr."""
    start = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(int(timeout)), only or "-", *types], capture_output=True, text=True,
                           timeout=timeout * len(types) + 60)
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(), "the process hung"
    rows = {r["type"]: r for r in (json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW "))}
    tail = (err.strip().splitlines() or ["no output"])[-1]
    for t in types:
        rows.setdefault(t, {"type": t, "driven": False, "error": f"traceback: {tail}", "seconds": round(time.time() - start, 1)})
    return [rows[t] for t in types]


def summary(row: dict) -> str:
    if not row["driven"]:
        return row["error"][:110]
    bad = {k: v for k, v in row["statuses"].items() if v in ("warn", "fail", "error")}
    counts = {}
    for v in row["statuses"].values():
        counts[v] = counts.get(v, 0) + 1
    text = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return text + ("; " + ", ".join(f"{k} {v}" for k, v in bad.items()) if bad else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="*")
    ap.add_argument("--popular", action="store_true", help="the POPULAR families only")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out")
    ap.add_argument("--only", help="comma-separated checks to run (default: the whole battery)")
    ap.add_argument("--per-process", type=int, default=1,
                    help="types checked by one subprocess (start-up is most of a type's time on a busy machine)")
    args = ap.parse_args()
    types = args.types or (POPULAR if args.popular else buildable_types())
    out = open(args.out, "a") if args.out else None
    rows = []
    print("| type | driven | statuses | s |\n|---|---|---|---|", flush=True)
    n = max(1, args.per_process)
    for i in range(0, len(types), n):
        for row in run_group(types[i : i + n], args.timeout, args.only):
            rows.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"| {row['type']} | {'yes' if row['driven'] else 'no'} | {summary(row)} | {row['seconds']} |", flush=True)
    driven = [r for r in rows if r["driven"]]
    clean = [r for r in driven if not any(v in ("warn", "fail", "error") for v in r["statuses"].values())]
    print(f"\n{len(types)} types: {len(driven)} driven, {len(clean)} of them clean (no warn, fail or error)")


if __name__ == "__main__":
    main()
