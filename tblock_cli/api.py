"""The Python API: check, params, bench and depth on a module, a factory, a SPEC or the built-in block.

The CLI is a client of these functions: it parses flags into the same option names and renders what
they return. Every report has `.ok` and `.to_dict()` (exactly what `--json` prints).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import runtime
from tblock_cli.config import BlockConfig, build_config
from tblock_cli.errors import ConfigError, LoadError
from tblock_cli.loading import ALIASES, Subject, builtin_subject, construct, parse_kwargs, user_subject
from tblock_cli.report import RunInfo

BLOCK_OPTIONS = tuple(f.name for f in dataclasses.fields(BlockConfig) if f.name != "warnings")
# Flags that shape only the built-in block: a user block gets d_model, n_heads, d_ff, dropout and
# causal through its constructor's signature, and anything else through kwargs.
BUILTIN_ONLY = ("norm", "activation", "eps", "bias")


@dataclass
class Setup:
    """Everything a command needs before it measures: the validated config, where it runs, the block."""

    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    make: Callable[[], Subject]  # builds (or wraps) the block; called after the memory gate
    block: str  # "built-in", a SPEC, or the module's class name
    kwargs: dict
    warnings: tuple[str, ...]

    def run(self, subject: Subject | None = None, **config) -> RunInfo:
        cfg = {**self.cfg.as_dict(), "block": self.block, "kwargs": self.kwargs, **config}
        name = subject.name if subject is not None else self.block
        return RunInfo(name, cfg, runtime.environment(self.device, self.dtype), self.warnings)


def _infer(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """A width or head count read from the module or its config under one of the usual names."""
    for m in [module, getattr(module, "config", None), *module.modules()]:
        for n in names:
            v = getattr(m, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def infer_d_model(module: nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            return m.normalized_shape[0]
    found = _infer(module, ALIASES["d_model"])
    if found:
        return found
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None


def infer_n_heads(module: nn.Module, d_model: int) -> int:
    mha = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)), None)
    if mha is not None:
        return mha.num_heads
    found = _infer(module, ALIASES["n_heads"])
    return found if found and d_model % found == 0 else math.gcd(d_model, 8)


@contextmanager
def threads(n: int | None):
    """torch's intra-op threads set to n for a while (None: untouched); restored after."""
    was = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def setup(block=None, options: dict | None = None, *, same_shape: bool = True, allow_mixed: bool = False,
          layers_apply: bool = False) -> Setup:
    """Options (the CLI flags' names) -> validated config, device, dtype and a way to build the block."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    preset = options.pop("preset", None)
    kwargs = options.pop("kwargs", None)
    unknown = sorted(set(options) - set(BLOCK_OPTIONS))
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(BLOCK_OPTIONS)}")
    if kwargs is not None and not isinstance(kwargs, (str, dict)):
        raise ConfigError("kwargs must be a dict or a JSON object string")
    extra = parse_kwargs(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
    warnings = []
    builtin = block is None
    if builtin and kwargs is not None:
        raise LoadError("--kwargs only applies with --block SPEC")
    if not builtin:
        given = [k for k in BUILTIN_ONLY + (() if layers_apply else ("layers",)) if k in options]
        if given:
            names = ", ".join("--" + k.replace("_", "-") for k in given)
            warnings.append(f"{names} shape(s) only the built-in block; the user block is built from its own code "
                            f"(pass its arguments with --kwargs)")
        for canonical in ("d_model", "n_heads", "d_ff"):  # --kwargs '{"dim": 64}' sizes the probe input too
            alias = next((a for a in ALIASES[canonical] if a in extra), None)
            if canonical not in options and alias is not None and isinstance(extra[alias], int):
                options[canonical] = extra[alias]
    module = None
    if isinstance(block, nn.Module):
        module, name = block, type(block).__name__
    elif block is not None and not isinstance(block, str):
        if not callable(block):
            raise ConfigError(f"block must be an nn.Module, a factory, a SPEC string or None, got {type(block).__name__}")
        name = getattr(block, "__name__", type(block).__name__)
    else:
        name = block or "built-in"
    if module is not None:
        if "d_model" not in options:
            d = infer_d_model(module)
            if d is None:
                raise ConfigError(f"cannot tell d_model from {name}: pass d_model=")
            options["d_model"] = d
        options.setdefault("n_heads", infer_n_heads(module, options["d_model"]))
    cfg = build_config(preset, allow_mixed=allow_mixed, builtin=builtin, **options)
    device = runtime.resolve_device(cfg.device)
    dtype = runtime.resolve_dtype(cfg.dtype, device)
    if isinstance(block, str) and block.startswith("hf:"):
        module, name, cfg = hf_block(block, cfg, options, extra)
    warnings.extend(cfg.warnings)

    def make() -> Subject:
        if block is None:
            return builtin_subject(cfg, device, dtype)
        if module is not None:
            return user_subject(module, name, cfg, device, dtype, same_shape=same_shape)
        if isinstance(block, str):
            from tblock_cli.loading import make_subject

            return make_subject(cfg, device, dtype, block, extra, same_shape=same_shape)
        return user_subject(construct(name, block, cfg, extra), name, cfg, device, dtype, same_shape=same_shape)

    return Setup(cfg, device, dtype, make, name if not isinstance(block, str) else block, extra, tuple(warnings))


def hf_block(spec: str, cfg: BlockConfig, options: dict, extra: dict) -> tuple[nn.Module, str, BlockConfig]:
    """An hf:TYPE block, and the config its model implies: causal for decoders, positions for rotary layers,
    HF's mask convention (attention_mask, 1 = keep). A flag the user gave explicitly stands."""
    from tblock_cli import hf

    module = hf.build(spec[3:], cfg, extra)
    implied = {"causal": module.causal, "positional": module.positional, "pad_keyword": "attention_mask", "pad_means": "keep"}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in implied.items() if k not in options})
    return module, spec, cfg


def check(block=None, *, strict: bool = False, progress: Callable[[str, str | None], None] | None = None,
          only=None, skip=None, fast: bool = False, **options):
    """Run the check battery. `block`: an nn.Module, a factory, a SPEC string, or None (built-in).
    only / skip: check names (a list or a comma-separated string); fast: leave out the slow checks.
    progress(check, detail) hears each check as it starts (detail None) and the long checks' probes."""
    from tblock_cli.checks import run_checks
    from tblock_cli.checks.battery import select

    chosen = select(only, skip, fast)  # a misspelt name is refused before the block is built
    s = setup(block, options, same_shape=False)
    with threads(s.cfg.threads):
        hf = isinstance(block, str) and block.startswith("hf:")
        runtime.ensure_fits(runtime.check_estimate(s.cfg, hf=hf), s.device, "check")
        subject = s.make()
        # again with the block's own parameter count (a gated FFN, an HF layer), less the weights now allocated
        n = sum(p.numel() for p in subject.module.parameters())
        runtime.ensure_fits(runtime.check_estimate(s.cfg, params=n, hf=hf) - n * s.dtype.itemsize, s.device, "check")
        return run_checks(subject, s.cfg, s.device, s.dtype, strict=strict, progress=progress,
                          run=s.run(subject, strict=strict), only=chosen)


def params(block=None, *, tree_depth: int | None = None, **options):
    """Parameters, bytes and FLOPs per component; rows by dataflow role (or the module tree to tree_depth)."""
    from tblock_cli.counting import param_report

    s = setup(block, options)
    if tree_depth is not None and tree_depth < 1:
        raise ConfigError(f"--tree-depth must be >= 1, got {tree_depth}")
    with threads(s.cfg.threads):
        if block is None:  # counted on the meta device: shapes without storage, so gpt2-xl allocates nothing
            subject = builtin_subject(s.cfg, torch.device("meta"), s.dtype)
        else:
            runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "params")
            subject = s.make()
        return param_report(subject, s.cfg, s.dtype, tree_depth, run=s.run(subject, tree_depth=tree_depth))


def bench(block=None, *, seq=(128, 512), need_weights: bool = False, mode: str = "both", baseline: str | None = None,
          min_time: float = 0.5, decode: int | None = None, breakdown: bool = False, compare_with: dict | None = None,
          progress: Callable[[str, int, int], None] | None = None, **options):
    """Latency, peak memory and the attention kernel, per sequence length and mode.

    decode=N also generates N tokens after a seq[0]-token prompt, with the block's KV cache and by
    recomputing the prefix (the built-in block is then causal); compare_with is a saved run's dict.
    """
    from tblock_cli.benchmark.run import check_sizes, run_bench, validate_bench
    from tblock_cli.benchmark.saved import config_mismatch

    seqs = validate_bench(seq, mode, baseline, min_time, decode)
    if decode and block is None:
        options = {**options, "causal": True}  # cached decoding is causal decoding
    s = setup(block, {**options, "seq": seqs[0]})
    modes = [] if decode and mode == "both" else (["infer", "train"] if mode == "both" else [mode])
    with threads(s.cfg.threads):
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


def load_saved(path: str) -> dict:
    """A run saved by bench --save; a clear error for a missing file or one that is not a tblock bench run."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"--compare {path}: cannot read it: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"--compare {path}: not JSON; give a file written by tblock bench --save") from None
    if not isinstance(data, dict) or not isinstance(data.get("schema_version"), int) or data.get("command") != "bench" \
            or not isinstance(data.get("results"), list):
        raise ConfigError(f"--compare {path}: not a tblock bench run (no schema_version / command 'bench' / results)")
    from tblock_cli.report import SCHEMA_VERSION

    if data["schema_version"] != SCHEMA_VERSION:
        raise ConfigError(f"--compare {path}: schema_version {data['schema_version']}, this tblock reads {SCHEMA_VERSION}")
    return data


def save_report(report, path: str) -> None:
    from tblock_cli.report import dumps

    try:
        with open(path, "w") as f:
            f.write(dumps(report.to_dict()) + "\n")
    except OSError as e:
        raise ConfigError(f"--save {path}: cannot write it: {e.strerror or e}") from None


def depth(block=None, *, compare: bool = False, strict: bool = False, final_norm: bool = True, **options):
    """A stack of N blocks at init: per-layer scale, gradients, residual gain, detected norm placement."""
    from tblock_cli.stacking import DepthComparison, run_depth

    if compare and (block is not None or options.get("norm") is not None):
        raise ConfigError("--compare runs the built-in pre, post and mixed stacks; drop --norm and --block")
    norms = ["pre", "post", "mixed"] if compare else [options.pop("norm", None)]
    reports = []
    for n in norms:
        s = setup(block, {**options, "norm": n, "final_norm": final_norm} if block is None else
                  {**options, "final_norm": final_norm}, allow_mixed=True, layers_apply=True)
        with threads(s.cfg.threads):
            runtime.ensure_fits(runtime.estimate_bytes(s.cfg), s.device, "depth")
            reports.append(run_depth(s.cfg, s.device, s.dtype, _layer_maker(s, block), strict=strict,
                                     run=s.run(strict=strict, compare=compare)))
    return DepthComparison(tuple(reports)) if compare else reports[0]


def _layer_maker(s: Setup, block) -> Callable[[int], list[Subject]] | None:
    """n independent layers of a user block: built anew per layer (seed + i), or copies re-initialised."""
    if block is None:
        return None
    if isinstance(block, str) and block.startswith("hf:"):
        from tblock_cli import hf

        def hf_layers(n: int) -> list[Subject]:
            first = s.make()  # the calling convention (mask keyword, causal); the layers come from an n-layer model
            return [first.like(layer) for layer in hf.build(block[3:], dataclasses.replace(s.cfg, layers=n), s.kwargs).single_layers()]
        return hf_layers
    if isinstance(block, str):
        from tblock_cli.loading import user_layers

        return lambda n: user_layers(s.cfg, s.device, s.dtype, block, s.kwargs, n)

    def copies(n: int) -> list[Subject]:
        first = s.make()
        layers = [first]
        for i in range(1, n):
            module = copy.deepcopy(first.module)
            torch.manual_seed(s.cfg.seed + i)
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            layers.append(first.like(module))
        return layers
    return copies


def assert_ok(report) -> None:
    """Raise AssertionError listing what failed, so a user's test is one line: assert_ok(check(MyBlock()))."""
    if report.ok:
        return
    failing = getattr(report, "failing", None)
    if failing:
        lines = [f"{c.name}: {c.status.value}: {c.detail}" for c in failing]
    else:
        lines = [f.text for f in getattr(report, "findings", ()) if getattr(f, "status", None) in ("warn", "fail")] or ["not ok"]
    raise AssertionError(f"tblock {type(report).__name__} not ok:\n  " + "\n  ".join(lines))
