"""The Python API: check, params, bench and depth on a module, a factory, a SPEC or the built-in block.

The CLI is a client of these functions: it parses flags into the same option names and renders what
they return. Every report has `.ok` and `.to_dict()` (exactly what `--json` prints).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from tblock_cli import runtime
from tblock_cli.errors import ConfigError
from tblock_cli.loading import builtin_subject
from tblock_cli.subject import check_options, layer_maker, setup


def check(block=None, *, strict: bool = False, progress: Callable[[str, str | None], None] | None = None,
          only=None, skip=None, fast: bool = False, tp: int | None = None, fsdp: int | None = None,
          tp_plan: str | None = None, **options):
    """Run the check battery. `block`: an nn.Module, a factory, a SPEC string, or None (built-in).
    only / skip: check names (a list or a comma-separated string); fast: leave out the slow checks.
    progress(check, detail) hears each check as it starts (detail None) and the long checks' probes.
    tp / fsdp: also check the block sharded over that many ranks (tp_plan: a JSON plan file for tp)."""
    from tblock_cli.checks import run_checks
    from tblock_cli.checks.battery import select
    from tblock_cli.distributed import prepare

    check_options({"strict": strict, "progress": progress, "tp": tp, "fsdp": fsdp, "tp_plan": tp_plan, "fast": fast},
                  strict=bool, progress=Callable, tp=int, fsdp=int, tp_plan=str, fast=bool)
    chosen = select(only, skip, fast)  # a misspelt name is refused before the block is built
    s = setup(block, options, same_shape=False)
    with s.session():
        hf = isinstance(block, str) and block.startswith("hf:")
        runtime.ensure_fits(runtime.check_estimate(s.cfg, hf=hf), s.device, "check")
        subject = s.make()
        # again with the block's own parameter count (a gated FFN, an HF layer), less the weights now allocated
        n = sum(p.numel() for p in subject.module.parameters())
        runtime.ensure_fits(runtime.check_estimate(s.cfg, params=n, hf=hf) - n * s.dtype.itemsize, s.device, "check")
        sharding = prepare(subject, s.cfg, s.device, s.dtype, tp=tp, fsdp=fsdp, tp_plan=tp_plan)
        distributed = {k: v for k, v in (("tp", tp), ("fsdp", fsdp), ("tp_plan", tp_plan)) if v is not None}
        return run_checks(subject, s.cfg, s.device, s.dtype, strict=strict, progress=progress,
                          run=s.run(subject, strict=strict, **distributed), sharding=sharding, only=chosen)


def params(block=None, *, tree_depth: int | None = None, **options):
    """Parameters, bytes and FLOPs per component; rows by dataflow role (or the module tree to tree_depth)."""
    from tblock_cli.counting import param_report

    check_options({"tree_depth": tree_depth}, tree_depth=int)
    if tree_depth is not None and tree_depth < 1:
        raise ConfigError(f"--tree-depth must be >= 1, got {tree_depth}")
    s = setup(block, options, trains=False)
    with s.session():
        if block is None and tree_depth is None:  # counted on the meta device: shapes without storage, so gpt2-xl
            subject = builtin_subject(s.cfg, torch.device("meta"), s.dtype)  # allocates nothing
        elif block is None:  # the module tree is read from one traced forward, which needs values
            runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "params")
            subject = builtin_subject(s.cfg, s.device, s.dtype)
        else:
            runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "params")
            subject = s.make()
        return param_report(subject, s.cfg, s.dtype, tree_depth, run=s.run(subject, tree_depth=tree_depth))


def bench(block=None, *, seq=None, need_weights: bool = False, mode: str | None = None, baseline: str | None = None,
          min_time: float = 0.5, decode: int | None = None, breakdown: bool = False, compare_with: dict | None = None,
          progress: Callable[[str, int, int], None] | None = None, tp: int | None = None, tp_plan: str | None = None,
          **options):
    """Latency, peak memory and the attention kernel, per sequence length and mode.

    decode=N also generates N tokens after a seq[0]-token prompt, with the block's KV cache and by
    recomputing the prefix (the built-in block is then causal); compare_with is a saved run's dict.
    seq None: 128 and 512 (bench --tp: 128); mode None: both (bench --tp: train, the only mode it times).
    """
    from tblock_cli.benchmark.options import bench_defaults, validate_bench
    from tblock_cli.benchmark.run import check_sizes, run_bench
    from tblock_cli.benchmark.saved import config_mismatch, validate_saved

    check_options(locals(), need_weights=bool, mode=str, baseline=str, min_time=float, decode=int, breakdown=bool,
                  compare_with=dict, progress=Callable, tp=int, tp_plan=str)
    if isinstance(seq, bool) or not isinstance(seq, (int, str, list, tuple, type(None))) or \
            (isinstance(seq, (list, tuple)) and not all(isinstance(n, int) and not isinstance(n, bool) for n in seq)):
        raise ConfigError(f"--seq must be an integer, a list of integers or a comma-separated string, got {seq!r}")
    seq, mode = bench_defaults(seq, mode, tp)
    seqs = validate_bench(seq, mode, baseline, min_time, decode)
    if compare_with is not None:
        validate_saved(compare_with, "compare_with")
    if tp is not None or tp_plan is not None:
        given = [f for f, on in (("--decode", decode), ("--breakdown", breakdown), ("--baseline", baseline),
                                 ("--compare", compare_with is not None), ("--need-weights", need_weights)) if on]
        if given:
            raise ConfigError(f"bench --tp times the sharded forward + backward alone; drop {', '.join(given)}")
        return _bench_tp(block, seqs[0], tp, tp_plan, options)
    if decode and block is None:
        options = {**options, "causal": True}  # cached decoding is causal decoding
    s = setup(block, {**options, "seq": seqs[0]})
    modes = [] if decode and mode == "both" else (["infer", "train"] if mode == "both" else [mode])
    with s.session():
        run = s.run(None, seq=seqs, mode=mode, need_weights=need_weights, baseline=baseline, min_time=min_time,
                    decode=decode, breakdown=breakdown)
        if compare_with is not None:
            diffs = config_mismatch(compare_with, run.config, run.environment)
            if diffs:
                raise ConfigError(f"--compare: the saved run has another config ({'; '.join(diffs)}); compare like with like")
        check_sizes(s.cfg, seqs, modes, s.device, decode)
        subject = s.make()
        run = dataclasses.replace(run, subject=subject.name)
        return run_bench(subject, s.cfg, s.device, s.dtype, seqs=seqs, modes=modes, need_weights=need_weights,
                         baseline=baseline == "torch", min_time=min_time, progress=progress, run=run,
                         decode=decode, breakdown=breakdown, compare_with=compare_with)


def _bench_tp(block, seq: int, tp: int | None, tp_plan: str | None, options: dict):
    """bench --tp N: the sharded block's forward + backward per rank, and its share in collectives."""
    from tblock_cli.distributed import prepare
    from tblock_cli.distributed.bench import run_tp_bench

    s = setup(block, {**options, "seq": seq})
    with s.session():
        runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "bench")
        subject = s.make()
        sharding = prepare(subject, s.cfg, s.device, s.dtype, tp=tp, fsdp=None, tp_plan=tp_plan)
        return run_tp_bench(subject, s.cfg, s.device, s.dtype, sharding.plan, tp,
                            s.run(subject, seq=seq, tp=tp, **({"tp_plan": tp_plan} if tp_plan else {})))


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


def depth(block=None, *, compare: bool = False, strict: bool = False, **options):
    """A stack of N blocks at init: per-layer scale, gradients, residual gain, detected norm placement."""
    from tblock_cli.stacking import DepthComparison, run_depth

    check_options({"compare": compare, "strict": strict}, compare=bool, strict=bool)
    if compare and (block is not None or options.get("norm") is not None):
        raise ConfigError("--compare runs the built-in pre, post and mixed stacks; drop --norm and --block")
    norms = ["pre", "post", "mixed"] if compare else [options.get("norm")]
    reports = []
    for n in norms:
        s = setup(block, {**options, "norm": n}, allow_mixed=True, layers_apply=True)
        with s.session():
            runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "depth")
            reports.append(run_depth(s.cfg, s.device, s.dtype, layer_maker(s, block), strict=strict,
                                     run=s.run(strict=strict, compare=compare)))
    return DepthComparison(tuple(reports)) if compare else reports[0]


def compare(a=None, b=None, *, kwargs_a=None, kwargs_b=None, dtype_b: str | None = None, compile: bool = False,
            backend: str | None = None, atol: float | None = None, rtol: float | None = None,
            map_file: str | None = None, **options):
    """A against B with A's weights carried across (or A against torch.compile(A)); a CompareReport."""
    from tblock_cli.comparing.run import run_compare

    return run_compare(a, b, setup, options=options, kwargs_a=kwargs_a, kwargs_b=kwargs_b, dtype_b=dtype_b,
                       compile=compile, backend=backend, atol=atol, rtol=rtol, map_file=map_file)


def assert_ok(report) -> None:
    """Raise AssertionError listing what failed, so a user's test is one line: assert_ok(check(MyBlock())).

    Works on every report (check, params, bench, depth, depth --compare): each has `ok` and `failing`
    (the check results or findings that made it not ok: fail, error, and warn under strict).
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
