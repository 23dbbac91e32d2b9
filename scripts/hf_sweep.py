"""Every transformers model type AutoConfig.for_model builds, checked as `--block hf:TYPE` at d_model 64.

Each type runs in its own subprocess with a timeout, so one hang or crash cannot stop the sweep. Prints a
Markdown table (type, driven, statuses, seconds); `--out FILE` also keeps one JSON line per type. Slow (minutes
per hundred types at one thread): kept out of the test suite.

    python scripts/hf_sweep.py --popular --out /tmp/hf_sweep.jsonl  # the popular families
    python scripts/hf_sweep.py --out /tmp/hf_sweep.jsonl            # every buildable type (hours)
    python scripts/hf_sweep.py --types llama t5 vit --timeout 120   # a few
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = """
import json, sys, time
import tblock_cli
from tblock_cli.errors import TBlockError
t0 = time.time()
try:
    r = tblock_cli.check("hf:" + sys.argv[1], d_model=64, n_heads=4, d_ff=256, threads=1)
    row = {"driven": True, "statuses": {c.name: c.status.value for c in r.checks},
           "notes": {c.name: c.detail for c in r.checks if c.status.value in ("warn", "fail", "error")},
           "warnings": list(r.run.warnings) if r.run else []}
except TBlockError as e:
    row = {"driven": False, "error": str(e)}
row["seconds"] = round(time.time() - t0, 1)
print("ROW " + json.dumps(row))
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


def run_one(t: str, timeout: float) -> dict:
    start = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, t], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"type": t, "driven": False, "error": f"timed out after {timeout:.0f} s", "seconds": round(time.time() - start, 1)}
    line = next((x for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
    if line is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"type": t, "driven": False, "error": f"traceback: {tail}", "seconds": round(time.time() - start, 1)}
    return {"type": t, **json.loads(line[4:])}


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
    args = ap.parse_args()
    types = args.types or (POPULAR if args.popular else buildable_types())
    out = open(args.out, "a") if args.out else None
    rows = []
    print("| type | driven | statuses | s |\n|---|---|---|---|", flush=True)
    for t in types:
        row = run_one(t, args.timeout)
        rows.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        print(f"| {t} | {'yes' if row['driven'] else 'no'} | {summary(row)} | {row['seconds']} |", flush=True)
    driven = [r for r in rows if r["driven"]]
    clean = [r for r in driven if not any(v in ("warn", "fail", "error") for v in r["statuses"].values())]
    print(f"\n{len(types)} types: {len(driven)} driven, {len(clean)} of them clean (no warn, fail or error)")


if __name__ == "__main__":
    main()
