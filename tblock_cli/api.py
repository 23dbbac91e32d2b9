"""The Python API: check, params, bench, depth and compare on a module, a factory, a SPEC or the built-in block.

The CLI is a client of these functions: it parses flags into the same option names and renders what they return.
Each function's first line judges its options (`options`, no torch needed); then one setup builds the block through
one pipeline (gate, build, gate, copy, wrap). Every report has `.ok` and `.to_dict()` (exactly what `--json` prints).
torch is imported when a function runs, not with this module.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

from tblock_cli import options as rules
from tblock_cli.errors import ConfigError

# The seed torch's default generator starts from when torch is imported (c10's default_rng_seed_val).
TORCH_START_SEED = 67280421310721


def keeps_rng(api_function: Callable) -> Callable:
    """torch's global random state as the caller had it, after, and a block's os._exit turned into an error: tblock
    seeds its weights and inputs for repeatable runs, never the caller's stream. A caller that has not imported torch yet gets it at its starting state (the
    option rules run before torch is imported, so a bad option still answers in a blink). functools.wraps keeps the
    real signature for help() and IDEs."""
    @functools.wraps(api_function)
    def kept(*args, **kwargs):
        import sys

        from tblock_cli.errors import exits_guarded

        if "torch" in sys.modules:
            from tblock_cli.runtime import kept_rng

            with kept_rng(), exits_guarded():
                return api_function(*args, **kwargs)
        try:
            with exits_guarded():  # a block's os._exit must not end the caller's process
                return api_function(*args, **kwargs)
        finally:
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.random.default_generator.manual_seed(TORCH_START_SEED)
    return kept


@keeps_rng
def check(block=None, *, strict: bool = False, progress: Callable[[str, str | None], None] | None = None,
          only=None, skip=None, fast: bool = False, tp: int | None = None, fsdp: int | None = None,
          tp_plan: str | None = None, like: str | None = None, like_kwargs=None, expect=None, **options):
    """Run the check battery on `block` (an nn.Module, a zero-argument factory, a SPEC string, or None for the
    built-in block) with the CLI's option names (d_model, n_heads, seq, batch, causal, dtype, ...).
    only / skip: check names (a list or a comma-separated string); fast: leave out the slow checks; strict: warnings fail.
    progress(check, detail) hears each check as it starts (detail None) and the long checks' probes.
    tp / fsdp: also check the block sharded over that many ranks (tp_plan: a JSON plan file for tp).
    like / like_kwargs / expect: what the block claims to be (see `spec`), judged by the spec and like_reference checks.
    Returns a CheckReport: `.ok`, `.checks`, `.to_dict()` (what `tblock check --json` prints)."""
    rules.check(block, options, strict=strict, progress=progress, fast=fast, tp=tp, fsdp=fsdp, tp_plan=tp_plan,
                like=like, like_kwargs=like_kwargs, expect=expect)
    from tblock_cli import runtime
    from tblock_cli.card.declare import declare
    from tblock_cli.checks import globalstate, run_checks
    from tblock_cli.checks.battery import select
    from tblock_cli.distributed import prepare
    from tblock_cli.subject.portable import indexes_checked
    from tblock_cli.subject.setup import setup

    chosen = select(only, skip, fast)  # a misspelt name is refused before the block is built
    s = setup(block, options, same_shape=False)
    with s.session(), indexes_checked(s.device):  # an index out of range raises on a CUDA device as on the CPU
        switches = globalstate.snapshot()  # what the block's constructor and build-time probes leave changed
        try:
            subject = s.build(lambda cfg, n: runtime.check_estimate(cfg, params=n, hf=s.hf), "check")
        finally:
            built = globalstate.changes(switches, globalstate.snapshot())
            globalstate.restore(switches)
        sharding = prepare(subject, s.cfg, s.device, s.dtype, tp=tp, fsdp=fsdp, tp_plan=tp_plan)
        distributed = {k: v for k, v in (("tp", tp), ("fsdp", fsdp), ("tp_plan", tp_plan)) if v is not None}
        declared = {k: v for k, v in (("like", like), ("like_kwargs", like_kwargs), ("expect", expect)) if v is not None}
        declaration = None
        if declared and (chosen is None or "spec" in chosen or "like_reference" in chosen):
            compared = like is not None and (chosen is None or "like_reference" in chosen)
            declaration = declare(like, like_kwargs, expect, s.cfg, setup, kwargs=s.kwargs,
                                  compare_with=(block if block is not None else "builtin") if compared else None,
                                  progress=(lambda d: progress("spec", d)) if progress else None)
        return run_checks(subject, s.cfg, s.device, s.dtype, strict=strict, progress=progress,
                          run=s.run_info(subject, strict=strict, **distributed, **declared), sharding=sharding, only=chosen,
                          declaration=declaration, noted=[("build", built)] if built else [])


@keeps_rng
def spec(block=None, *, like: str | None = None, like_kwargs=None, expect=None,
         progress: Callable[[str], None] | None = None, **options):
    """The block's spec card: what it computes (rotary base and dims, score scale, soft-cap, activation, eps, residual
    form, router, ...), each entry read black-box from its dataflow and probes. like="hf:TYPE" (with like_kwargs, that
    layer's config overrides) and expect=["KEY=VALUE", ...] declare what it should be: each claim is judged.
    Returns a SpecReport: `.ok`, `.card`, `.verdicts`, `.to_dict()` (what `tblock spec --json` prints)."""
    rules.spec(block, options, like=like, like_kwargs=like_kwargs, expect=expect, progress=progress)
    from tblock_cli import runtime
    from tblock_cli.card.declare import declare
    from tblock_cli.card.entries import judge
    from tblock_cli.card.read import read_card
    from tblock_cli.card.report import SpecReport
    from tblock_cli.checks.zeros import drawn_at_random, hiding_zeros, zeros_note
    from tblock_cli.subject.portable import indexes_checked
    from tblock_cli.subject.setup import setup

    s = setup(block, options, trains=False)
    with s.session(), indexes_checked(s.device):
        subject = s.build(lambda cfg, n: runtime.estimate_bytes(cfg, params=n, copies=2), "spec")
        zeros = hiding_zeros(subject.module)  # a zero output projection hides its branch: read at random weights
        with drawn_at_random(subject.module, zeros), runtime.compiled_run_eagerly():
            card = read_card(subject, s.cfg, s.device, progress)
        if progress is not None and like:
            progress(f"reading {like}")
        declaration = declare(like, like_kwargs, expect, s.cfg, setup)
        declared = {k: v for k, v in (("like", like), ("like_kwargs", like_kwargs), ("expect", expect)) if v is not None}
        run = s.run_info(subject, **declared)
        if zeros:
            run = replace(run, warnings=run.warnings + (zeros_note(zeros, "the card was read"),))
        return SpecReport(card, judge(card, declaration.claims), declaration.reference, like, run)


@keeps_rng
def params(block=None, *, tree_depth: int | None = None, **options):
    """Parameters, bytes and FLOPs per component by dataflow role (tree_depth=N: rows from the module tree); a ParamReport."""
    rules.params(block, options, tree_depth=tree_depth)
    import torch

    from tblock_cli import runtime
    from tblock_cli.params_report import param_report
    from tblock_cli.subject.loading import builtin_subject
    from tblock_cli.subject.setup import setup

    s = setup(block, options, trains=False)
    with s.session():
        if block is None and tree_depth is None:  # counted on the meta device: shapes without storage, so gpt2-xl
            subject = builtin_subject(s.cfg, torch.device("meta"), s.dtype)  # allocates nothing
        else:  # the module tree is read from one traced forward, which needs values
            subject = s.build(lambda cfg, n: runtime.estimate_bytes(cfg, params=n), "params")
        with runtime.compiled_run_eagerly():
            return param_report(subject, s.cfg, s.dtype, tree_depth, run=s.run_info(subject, tree_depth=tree_depth))


@keeps_rng
def bench(block=None, *, seq=None, need_weights: bool = False, mode: str | None = None, baseline: str | None = None,
          min_time: float = 0.5, decode: int | None = None, breakdown: bool = False, compare_with: dict | None = None,
          progress: Callable[[str, int, int], None] | None = None, tp: int | None = None, tp_plan: str | None = None,
          **options):
    """Latency (median, IQR), peak memory and the attention kernel, per sequence length and mode; a BenchReport.

    decode=N also generates N tokens after a seq[0]-token prompt, with the block's KV cache and by
    recomputing the prefix (the built-in block is then causal); compare_with is a saved run's dict.
    seq None: 128 and 512 (bench --tp: 128); mode None: both (bench --tp: train, the only mode it times).
    """
    seqs, mode = rules.bench(block, options, seq=seq, need_weights=need_weights, mode=mode, baseline=baseline,
                             min_time=min_time, decode=decode, breakdown=breakdown, compare_with=compare_with,
                             progress=progress, tp=tp, tp_plan=tp_plan)
    from tblock_cli import runtime
    from tblock_cli.benchmark.run import run_bench
    from tblock_cli.benchmark.saved import config_mismatch
    from tblock_cli.subject.setup import setup

    if tp is not None or tp_plan is not None:
        return _bench_tp(block, seqs[0], tp, tp_plan, options)
    if decode and block is None:
        options = {**options, "causal": True}  # cached decoding is causal decoding
    s = setup(block, {**options, "seq": seqs[0]})
    modes = [] if decode and mode == "both" else (["infer", "train"] if mode == "both" else [mode])
    longest = max(seqs + ([seqs[0] + decode] if decode else []))  # the estimate grows with seq: the longest point

    def estimate(cfg, n):
        return runtime.bench_estimate(cfg, seq=longest, train="train" in modes, params=n)

    with s.session():
        subject = s.build(estimate, f"bench at seq {longest}")
        run = s.run_info(subject, seq=seqs, mode=mode, need_weights=need_weights, baseline=baseline, min_time=min_time,
                    decode=decode, breakdown=breakdown)
        if compare_with is not None:
            diffs = config_mismatch(compare_with, run.config, run.environment)
            if diffs:
                raise ConfigError(f"--compare: the saved run has another config ({'; '.join(diffs)}); compare like with like")
        return run_bench(subject, s.cfg, s.device, s.dtype, seqs=seqs, modes=modes, need_weights=need_weights,
                         baseline=baseline == "torch", min_time=min_time, progress=progress, run=run,
                         decode=decode, breakdown=breakdown, compare_with=compare_with)


def _bench_tp(block, seq: int, tp: int | None, tp_plan: str | None, options: dict):
    """bench --tp N: the sharded block's forward + backward per rank, and its share in collectives."""
    from tblock_cli import runtime
    from tblock_cli.distributed import prepare
    from tblock_cli.distributed.timing import run_tp_bench
    from tblock_cli.subject.setup import setup

    s = setup(block, {**options, "seq": seq})
    with s.session():
        subject = s.build(lambda cfg, n: runtime.estimate_bytes(cfg, params=n), "bench")
        sharding = prepare(subject, s.cfg, s.device, s.dtype, tp=tp, fsdp=None, tp_plan=tp_plan)
        return run_tp_bench(subject, s.cfg, s.device, s.dtype, sharding.plan, tp,
                            s.run_info(subject, seq=seq, tp=tp, **({"tp_plan": tp_plan} if tp_plan else {})))


def load_saved(path: str) -> dict:
    """A run saved by bench --save, read and validated; a ConfigError naming what is wrong with anything else."""
    from tblock_cli.benchmark.saved import load_saved as load

    return load(path)


def ensure_save_target(path: str) -> None:
    """Refuse, before measuring, a --save path that cannot be written or holds something other than a saved run."""
    from tblock_cli.benchmark.saved import ensure_save_target as ensure

    ensure(path)


def save_report(report, path: str) -> None:
    from tblock_cli.report import dumps

    try:
        with open(path, "w") as f:
            f.write(dumps(report.to_dict()) + "\n")
    except OSError as e:
        raise ConfigError(f"--save {path}: cannot write it: {e.strerror or e}") from None


@keeps_rng
def depth(block=None, *, compare: bool = False, strict: bool = False, **options):
    """A stack of `layers` blocks at init: per-layer scale, gradients, residual gain, detected norm placement; a
    DepthReport (compare=True: the built-in pre, post and mixed stacks side by side, a DepthComparison)."""
    rules.depth(block, options, compare=compare, strict=strict)
    from tblock_cli import runtime
    from tblock_cli.depth_report import DepthComparison, run_depth
    from tblock_cli.subject.setup import layer_maker, setup

    norms = ["pre", "post", "mixed"] if compare else [options.get("norm")]
    reports = []
    for n in norms:
        s = setup(block, {**options, "norm": n}, allow_mixed=True, layers_apply=True)
        with s.session():
            s.gate(lambda cfg, _n: runtime.estimate_bytes(cfg), "depth")  # the stack is built layer by layer
            s.resolve()
            reports.append(run_depth(s.cfg, s.device, s.dtype, layer_maker(s, block), strict=strict,
                                     run=s.run_info(strict=strict, compare=compare)))
    return DepthComparison(tuple(reports)) if compare else reports[0]


@keeps_rng
def compare(a=None, b=None, *, kwargs_a=None, kwargs_b=None, dtype_b: str | None = None, compile: bool = False,
            backend: str | None = None, atol: float | None = None, rtol: float | None = None,
            map_file: str | None = None, **options):
    """Two implementations of one block (SPECs, modules, or "builtin" for the built-in block; A may also be None)
    with A's weights carried to B; B is None only with compile=True: outputs, gradients and decoding compared, the
    first differing role output named.
    Options: the shared size flags, kwargs_a, kwargs_b, dtype_b, atol, rtol, map_file; compile=True holds A
    against torch.compile(A), on backend= inductor, aot_eager or eager. Returns a CompareReport: `.ok`, `.findings`, `.to_dict()`."""
    rules.compare(a, b, options, kwargs_a=kwargs_a, kwargs_b=kwargs_b, dtype_b=dtype_b, compile=compile,
                  backend=backend, atol=atol, rtol=rtol, map_file=map_file)
    from tblock_cli.comparing.run import run_compare
    from tblock_cli.subject.setup import setup

    return run_compare(a, b, setup, options=options, kwargs_a=kwargs_a, kwargs_b=kwargs_b, dtype_b=dtype_b,
                       compile=compile, backend=backend, atol=atol, rtol=rtol, map_file=map_file)


def assert_ok(report) -> None:
    """Raise AssertionError listing what failed, so a user's test is one line: assert_ok(check(MyBlock())).

    Works on every report (check, params, bench, depth, depth --compare): each has `ok` and `failing`
    (the check results or findings that made it not ok: fail, error, and warn under strict); anything else is a
    ConfigError (and a TypeError).
    """
    from tblock_cli.errors import NotAReport
    from tblock_cli.report import Status

    if not (isinstance(getattr(report, "ok", None), bool) and hasattr(report, "findings") and hasattr(report, "to_dict")):
        raise NotAReport(f"assert_ok takes a report returned by tblock_cli.check, params, bench or depth, "
                         f"got {type(report).__name__}")
    if report.ok:
        return
    failing = getattr(report, "failing", None)
    if failing is None:  # a report that only has findings: what is not info or pass
        failing = [f for f in report.findings if f.status not in (Status.INFO, Status.PASS, Status.SKIP)]
    lines = [f"{getattr(f, 'name', None) or f.kind}: {f.status.value}: {f.text}" for f in failing] or ["not ok"]
    raise AssertionError(f"tblock {type(report).__name__} not ok:\n  " + "\n  ".join(lines))
