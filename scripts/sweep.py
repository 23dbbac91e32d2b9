"""The false-alarm sweep and the planted-bug sweep: the numbers docs/checks.md quotes.

    python scripts/sweep.py            # both sweeps; exit 1 on any false alarm or missed bug
    python scripts/sweep.py --quick    # float32 only, d_model 64 only
    python scripts/sweep.py --quick --device cuda --shard 1/4   # a quarter of the blocks, on a GPU

False alarms: every correct block x float32/float16/bfloat16 x d_model 64/512 x seq 10/64 must give no
warn, fail or error. Missed bugs: every planted bug must make `check --strict` fail, at the default sizes
and at --d-model 64 --n-heads 4 --d-ff 256.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import zoo_accumulation  # noqa: E402
import zoo_adapters  # noqa: E402
import zoo_attention  # noqa: E402
import zoo_autocast  # noqa: E402
import zoo_backward  # noqa: E402
import zoo_buckets  # noqa: E402
import zoo_claims  # noqa: E402
import zoo_classes  # noqa: E402
import zoo_complex  # noqa: E402
import zoo_construction  # noqa: E402
import zoo_designs  # noqa: E402
import zoo_device  # noqa: E402
import zoo_dropout  # noqa: E402
import zoo_families  # noqa: E402
import zoo_float_only  # noqa: E402
import zoo_framework_names  # noqa: E402
import zoo_global  # noqa: E402
import zoo_grids  # noqa: E402
import zoo_history  # noqa: E402
import zoo_hooks  # noqa: E402
import zoo_init  # noqa: E402
import zoo_length  # noqa: E402
import zoo_numerics  # noqa: E402
import zoo_paths  # noqa: E402
import zoo_rates  # noqa: E402
import zoo_recent  # noqa: E402
import zoo_routing  # noqa: E402
import zoo_sizes  # noqa: E402
import zoo_steps  # noqa: E402
import zoo_stretch  # noqa: E402
import zoo_switches  # noqa: E402
import zoo_tables  # noqa: E402
import zoo_training  # noqa: E402
import zoo_writes  # noqa: E402
import zoo_xpos  # noqa: E402

import tblock_cli  # noqa: E402
from tblock_cli.checks import Status  # noqa: E402
from tblock_cli.errors import LoadError  # noqa: E402

import zoo  # noqa: E402

BAD = {Status.WARN, Status.FAIL, Status.ERROR}
BUILTIN = {"built-in pre": {"norm": "pre"}, "built-in post": {"norm": "post"}, "built-in causal": {"causal": True}}
CORRECT = {**{k: v for k, v in zoo.CORRECT.items() if k != "NoPadKeyword"}, **{k: {"causal": True} for k in zoo.CACHED_CORRECT},
           **zoo.CORRECT_3}
CORRECT.update({f"zoo_training.py:{k}": {} for k in zoo_training.CORRECT})  # the training-time checks' twins
CORRECT.update({f"zoo_backward.py:{k}": {} for k in zoo_backward.CORRECT})  # a hand-written backward that reshapes
CORRECT.update({f"zoo_buckets.py:{k}": {"causal": "Decoder" in k} for k in zoo_buckets.CORRECT})  # T5's buckets
CORRECT.update({f"zoo_dropout.py:{k}": {} for k in zoo_dropout.CORRECT})  # the dropout check's
CORRECT.update({f"zoo_device.py:{k}": {} for k in zoo_device.CORRECT})  # the device check's
CORRECT.update({f"zoo_hooks.py:{k}": {} for k in zoo_hooks.CORRECT})  # gradient hooks carried to the copies
CORRECT.update({f"zoo_float_only.py:{k}": {} for k in zoo_float_only.CORRECT})  # float32 code the float64 copies skip
FLOAT32_ONLY = {f"zoo_float_only.py:{k}" for k in zoo_float_only.CORRECT}  # their code refuses half precision, by design
CORRECT.update({f"zoo_autocast.py:{k}": {} for k in zoo_autocast.CORRECT})  # mixed precision that runs
CORRECT.update({f"zoo_claims.py:{k}": {"causal": True} for k in zoo_claims.CORRECT})  # what blocks say of themselves
CORRECT.update({f"zoo_claims.py:{k}": {} for k in zoo_claims.SAID_CAUSAL_CORRECT})  # causal by their own word
CORRECT.update({f"zoo_length.py:{k}": {"causal": True} for k in zoo_length.CORRECT})  # the length probes'
CORRECT.update({f"zoo_init.py:{k}": {} for k in zoo_init.CORRECT})  # zero initialisations that train
CORRECT.update({f"zoo_history.py:{k}": {} for k in zoo_history.CORRECT + zoo_history.CORRECT_STEP})  # caches that follow
CORRECT.update({f"zoo_numerics.py:{k}": {} for k in zoo_numerics.CORRECT})  # numerics and construction that train
CORRECT.update({f"zoo_accumulation.py:{k}": {} for k in zoo_accumulation.CORRECT})  # custom backwards that accumulate
CORRECT.update({f"zoo_tables.py:{k}": {"causal": True} for k in zoo_tables.CORRECT})  # Switch's top-1 routing
CORRECT.update({f"zoo_sizes.py:{k}": {"causal": True} for k in zoo_sizes.CORRECT})  # sizes and gains as said
CORRECT.update({f"zoo_switches.py:{k}": {"causal": True} for k in zoo_switches.CORRECT})  # switches as said
CORRECT.update({f"zoo_framework_names.py:{k}": {"causal": True} for k in zoo_framework_names.CORRECT})  # litgpt, OLMo...
CORRECT.update({f"zoo_stretch.py:{k}": {"causal": True} for k in zoo_stretch.CORRECT if k not in zoo_stretch.SPEC_ONLY})  # LongRoPE, dynamic NTK, clip_qkv
CORRECT.update({f"zoo_routing.py:{k}": {"causal": k not in zoo_routing.BIDIRECTIONAL} for k in zoo_routing.CORRECT})  # group-limited routing, d_kv
CORRECT.update({f"zoo_classes.py:{k}": {"causal": True} for k in zoo_classes.CORRECT})  # classes named for what they compute
CORRECT.update({f"zoo_families.py:{k}": {"causal": True} for k in zoo_families.CORRECT})  # Qwen3, Gemma, Cohere
CORRECT.update({f"zoo_paths.py:{k}": {"causal": True} for k in zoo_paths.CORRECT})  # a straight-through, a sparse MoE
CORRECT.update({f"zoo_attention.py:{k}": {"causal": True} for k in zoo_attention.CORRECT})  # softmax1, a sink
CORRECT.update({f"zoo_rates.py:{k}": {"causal": True} for k in zoo_rates.CORRECT})  # attention dropout applied, a frozen table
CORRECT.update({f"zoo_construction.py:{k}": {} for k in zoo_construction.CORRECT})  # built as asked
CORRECT.update({f"zoo_steps.py:{k}": {"causal": True} for k in zoo_steps.CORRECT})  # a loss kept per call, a biased norm
CORRECT.update({f"zoo_writes.py:{k}": {"causal": True} for k in zoo_writes.CORRECT})  # buffers a forward may write
CORRECT.update({f"zoo_complex.py:{k}": {"causal": True} for k in zoo_complex.CORRECT})  # a complex rotary buffer
CORRECT.update({f"zoo_grids.py:{k}": {"seqs": (zoo_grids.TOKENS,)} for k in zoo_grids.CORRECT})  # 2D positions
CORRECT.update({f"zoo_xpos.py:{k}": {"causal": True} for k in zoo_xpos.CORRECT})  # tables made by an einsum
CORRECT.update({f"zoo_designs.py:{k}": {"causal": k not in zoo_designs.BIDIRECTIONAL} for k in zoo_designs.CORRECT})  # libraries' designs
CORRECT.update({f"zoo_adapters.py:{k}": {"causal": True} for k in zoo_adapters.CORRECT})  # LoRA, DoRA, spectral norm
CORRECT.update({f"zoo_recent.py:{k}": {"causal": k not in zoo_recent.BIDIRECTIONAL} for k in zoo_recent.CORRECT})  # Primer, Conformer
# switches put back, a train() override (PythonLayerDrop's checkpointing warning is told: Python's stream redrawn)
CORRECT.update({f"zoo_global.py:{k}": {"causal": True} for k in zoo_global.CORRECT if k != "PythonLayerDrop"})
FLOAT32_ONLY.add("zoo_global.py:ForkedNoise")  # its noise is drawn in float32 and meets the run's dtype: it refuses half
# logits doubled at init by talking heads started as the identity: told from unscaled ones with heads of 64 or more
CORRECT["zoo_designs.py:AddedTalkingHeadsBlock"] = {"causal": True, "n_heads": 1}
# Hugging Face layers, when transformers is installed: every family tblock drives, flags implied.
HF = ["gpt2", "bert", "roberta", "llama", "mistral", "qwen2", "gemma", "phi3", "gpt_neox"]


def spec(name: str) -> str:
    return f"{TESTS / name}" if ":" in name else f"{TESTS / 'zoo.py'}:{name}"


def correct_blocks() -> list[tuple[str, dict]]:
    blocks = [*BUILTIN.items(), *CORRECT.items()]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return blocks
    return blocks + [(f"hf:{t}", {}) for t in HF]


def shard(items: list, part: tuple[int, int]) -> list:
    """Every n-th item from the k-th on (part = (k, n), k from 1): shards that run side by side split a sweep."""
    k, n = part
    return items[k - 1::n]


def false_alarms(dtypes, widths, seqs, only=None, device="cpu", part=(1, 1)) -> int:
    alarms = runs = refused = 0
    blocks = shard([b for b in correct_blocks() if only is None or b[0] in only], part)
    for name, flags in blocks:
        for dtype in dtypes:
            if name in FLOAT32_ONLY and dtype != "float32":
                continue
            for d in widths:
                for seq in flags.get("seqs", seqs):  # a block of one length (a patch grid) at its own only
                    block = None if name.startswith("built-in") else name if name.startswith("hf:") else spec(name)
                    try:
                        heads = flags.get("n_heads", 8 if d >= 512 else 4)
                        rest = {k: v for k, v in flags.items() if k not in ("n_heads", "seqs")}
                        r = tblock_cli.check(block, d_model=d, n_heads=heads, seq=seq, dtype=dtype, device=device, **rest)
                    except LoadError as e:  # a block written for float32 that cannot run in this dtype: exit 2, one line
                        refused += 1
                        print(f"  {name} {dtype} d_model {d} seq {seq}: refused ({str(e)[-100:]})", flush=True)
                        continue
                    except Exception as e:  # noqa: BLE001 - tblock itself raised: an alarm, and the sweep goes on
                        runs += 1
                        alarms += 1
                        print(f"FALSE ALARM {name} {dtype} d_model {d} seq {seq}: tblock raised {type(e).__name__}: "
                              f"{str(e)[:300]}", flush=True)
                        continue
                    bad = [c for c in r.checks if c.status in BAD]
                    runs += 1
                    print(f"  {name} {dtype} d_model {d} seq {seq}: {'ok' if not bad else 'ALARM'}", flush=True)
                    if bad:
                        alarms += 1
                        print(f"FALSE ALARM {name} {dtype} d_model {d} seq {seq}: " +
                              "; ".join(f"{c.name} {c.status.value}: {c.detail[:120 if device == 'cpu' else 400]}" for c in bad))
    print(f"false-alarm sweep: {runs} runs of {len(blocks)} correct blocks, {alarms} with a warn/fail/error"
          + (f"; {refused} refused to load in their dtype (exit 2)" if refused else ""))
    return alarms


def missed_bugs(sizes, device="cpu", part=(1, 1)) -> int:
    planted = {**{k: v for k, v in zoo.PLANTED.items()}, **zoo.PLANTED_2, **{k: (v, {}) for k, v in zoo.WARNED.items()},
               **{k: ("kv_cache", {"causal": True}) for k in zoo.CACHE_BUGS}, **zoo.PLANTED_3,
               **{f"zoo_training.py:{k}": (v, {}) for k, v in zoo_training.PLANTED.items()},
               **{f"zoo_backward.py:{k}": (v, {}) for k, v in zoo_backward.PLANTED.items()},
               **{f"zoo_buckets.py:{k}": ("spec", {"causal": "Decoder" in k}) for k in zoo_buckets.PLANTED},
               **{f"zoo_dropout.py:{k}": ("dropout", {}) for k in {**zoo_dropout.PLANTED, **zoo_dropout.IGNORED}},
               **{f"zoo_device.py:{k}": ("device", {}) for k in zoo_device.PLANTED},
               **{f"zoo_hooks.py:{k}": (v, {}) for k, v in zoo_hooks.PLANTED.items()},
               **{f"zoo_autocast.py:{k}": (v, {}) for k, v in zoo_autocast.PLANTED.items()},
               **{f"zoo_claims.py:{k}": ("spec", {"causal": True}) for k in zoo_claims.PLANTED},
               **{f"zoo_claims.py:{k}": ("causal", {}) for k in zoo_claims.SAID_CAUSAL},
               **{f"zoo_length.py:{k}": (check, {"causal": True}) for k, (check, _) in zoo_length.PLANTED.items()},
               **{f"zoo_init.py:{k}": (v, {}) for k, v in zoo_init.PLANTED.items()},
               **{f"zoo_init.py:{k}": ("optimizer_step", {}) for k in zoo_init.SYMMETRIC},
               **{f"zoo_history.py:{k}": (v, {}) for k, v in zoo_history.PLANTED.items()},
               **{f"zoo_numerics.py:{k}": (check, {}) for k, (check, _) in zoo_numerics.PLANTED.items()},
               **{f"zoo_accumulation.py:{k}": (v, {}) for k, v in zoo_accumulation.PLANTED.items()},
               **{f"zoo_tables.py:{k}": (v, {"causal": True}) for k, v in {**zoo_tables.WARNED, **zoo_tables.FAILED}.items()},
               **{f"zoo_tables.py:{k}": ("spec", {"causal": True}) for k in zoo_tables.PLANTED},
               **{f"zoo_sizes.py:{k}": ("spec", {"causal": True}) for k in zoo_sizes.PLANTED},
               **{f"zoo_switches.py:{k}": ("spec", {"causal": True}) for k in zoo_switches.PLANTED},
               **{f"zoo_framework_names.py:{k}": ("spec", {"causal": True}) for k in zoo_framework_names.PLANTED},
               **{f"zoo_stretch.py:{k}": ("spec", {"causal": True}) for k in zoo_stretch.PLANTED},
               **{f"zoo_routing.py:{k}": ("spec", {"causal": True}) for k in zoo_routing.PLANTED},
               **{f"zoo_families.py:{k}": ("spec", {"causal": True}) for k in zoo_families.PLANTED},
               **{f"zoo_classes.py:{k}": ("spec", {"causal": True}) for k in zoo_classes.PLANTED},
               **{f"zoo_paths.py:{k}": (check, {"causal": True}) for k, (check, _) in zoo_paths.PLANTED.items()},
               **{f"zoo_rates.py:{k}": (v.split(".")[0], {"causal": True}) for k, v in zoo_rates.PLANTED.items()},
               **{f"zoo_construction.py:{k}": (v, {}) for k, v in zoo_construction.PLANTED.items()},
               **{f"zoo_steps.py:{k}": (check, {"causal": "BatchNorm" not in k}) for k, (check, _) in zoo_steps.PLANTED.items()},
               **{f"zoo_writes.py:{k}": (v, {}) for k, v in zoo_writes.PLANTED.items()},
               **{f"zoo_complex.py:{k}": (v, {"causal": True}) for k, v in zoo_complex.PLANTED.items()},
               **{f"zoo_grids.py:{k}": (v, {"seq": zoo_grids.TOKENS}) for k, v in zoo_grids.PLANTED.items()},
               **{f"zoo_global.py:{k}": ("global_state", {}) for k in zoo_global.PLANTED},
               **{f"zoo_adapters.py:{k}": (v.split(".")[0], {"causal": True})
                  for k, v in {**zoo_adapters.PLANTED, **zoo_adapters.WARNED}.items()}}
    missed = runs = 0
    planted = dict(shard(list(planted.items()), part))
    # On an accelerator a block that leaves a tensor on the host fails wherever it meets the device: at load (its
    # forward refuses to run, exit 2) or in any training check; the `device` check is the CPU's way to see it.
    elsewhere = device != "cpu"
    for name, (check, flags) in planted.items():
        for size in sizes:
            merged = {**size, **flags}  # a "dtype" flag names the run dtype the bug needs
            runs += 1
            try:
                r = tblock_cli.check(spec(name), strict=True, device=device, **merged)
            except LoadError as e:
                if not (elsewhere and name.startswith("zoo_device.py:")):
                    missed += 1
                print(f"{'REFUSED' if elsewhere else 'MISSED'} {name} {merged}: at load ({str(e)[-120:]})")
                continue
            by = {c.name: c for c in r.checks}
            if elsewhere and name.startswith("zoo_device.py:") and not r.ok:
                continue
            if r.ok or by[check].status not in BAD:
                missed += 1
                print(f"MISSED {name} {merged}: {check} is {by[check].status.value}: {by[check].detail[:120]}"
                      + (f" | {str(by[check].facts)[:600]}" if elsewhere else ""))
    print(f"planted-bug sweep: {len(planted)} planted bugs x {len(sizes)} sizes = {runs} runs, {missed} not caught by check --strict")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="float32 and d_model 64 only")
    parser.add_argument("--dtypes", help="comma-separated dtypes for the false-alarm sweep (default: by --quick)")
    parser.add_argument("--widths", help="comma-separated d_model values for the false-alarm sweep (default: by --quick)")
    parser.add_argument("--only", help="comma-separated block names (zoo names or hf:TYPE) to sweep for false alarms")
    parser.add_argument("--no-bugs", action="store_true", help="skip the planted-bug sweep")
    parser.add_argument("--no-alarms", action="store_true", help="skip the false-alarm sweep")
    parser.add_argument("--bug-sizes", metavar="D/H/F,...",
                        help="the planted-bug sweep's sizes as d_model/n_heads/d_ff (default: the defaults and 64/4/256)")
    parser.add_argument("--device", default="cpu", help="where the blocks run (cuda on a GPU machine)")
    parser.add_argument("--shard", default="1/1", metavar="K/N", help="every N-th block from the K-th: shards side by side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] if args.quick else ["float32", "float16", "bfloat16"]
    widths = [int(w) for w in args.widths.split(",")] if args.widths else [64] if args.quick else [64, 512]
    part = tuple(int(x) for x in args.shard.split("/"))
    bad = 0 if args.no_alarms else false_alarms(dtypes, widths, [10, 64], args.only.split(",") if args.only else None,
                                                args.device, part)
    sizes = [{}, {"d_model": 64, "n_heads": 4, "d_ff": 256}]
    if args.bug_sizes:
        sizes = [dict(zip(("d_model", "n_heads", "d_ff"), map(int, s.split("/")))) for s in args.bug_sizes.split(",")]
    if not args.no_bugs:
        bad += missed_bugs(sizes, args.device, part)
    print(f"{time.perf_counter() - t0:.0f} s, torch {torch.__version__}, 1 thread, {args.device}, shard {args.shard}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
