"""The battery: every check declared once (name, function, needs, what it establishes, what it catches), and the runner."""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch

from tblock_cli import runtime
from tblock_cli.checks import (
    accumulation,
    alignment,
    attention,
    batch,
    checkpointing,
    claims,
    device,
    dropout,
    finite,
    forward,
    globalstate,
    gradients,
    lifecycle,
    mixing,
    naming,
    norms,
    optimizer,
    order,
    positions,
    precision,
    safety,
    structure,
    training,
)
from tblock_cli.checks.context import Context
from tblock_cli.checks.cost import PassCounter, Passes
from tblock_cli.checks.forward import fingerprint
from tblock_cli.checks.result import CheckReport, CheckResult, Outcome
from tblock_cli.checks.sharded import check_fsdp, check_tensor_parallel
from tblock_cli.checks.zeros import as_built, drawn_at_random, hiding_zeros, zeros_note
from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, ConfigError, is_out_of_memory, one_line
from tblock_cli.report import RunInfo, Status
from tblock_cli.subject import Subject

# What a need means, as the docs table names it.
NEEDS = {"shape": "shape", "finite": "finite", "deterministic": "deterministic", "input_kept": "input kept",
         "independent": "independent samples", "train_safe": "repeatable training step", "copyable": "faithful deepcopy"}
COMPARES = ("shape", "finite", "deterministic")  # checks that compare two forwards of random inputs
GRADS = ("finite", "input_kept")  # checks that take a gradient through the block


@dataclass(frozen=True)
class Check:
    """One check: its name, its function, the needs it waits for, the need it establishes; what it catches (the docs'
    words) is the 'Catches:' paragraph of its function's docstring, beside the code that catches it."""

    name: str
    function: Callable[[Context], Outcome]
    needs: tuple[str, ...] = ()
    establishes: str | None = None  # left unmet when the check fails or errors (or says so in its outcome)
    slow: bool = False  # left out by --fast: its cost is many forwards of the block (see docs/performance.md)
    as_built: bool = False  # judges the init itself: weights that start at zero stay zero for it (checks/zeros.py)

    @property
    def catches(self) -> str:
        doc = inspect.getdoc(self.function) or ""
        _, marker, text = doc.partition("Catches: ")
        return " ".join(text.split()) if marker else ""


REGISTRY: tuple[Check, ...] = (
    Check("shape", forward.check_shape, (), "shape"),
    Check("finite", finite.check_finite, (), "finite"),
    Check("determinism", forward.check_determinism, ("finite",), "deterministic"),
    Check("input_unchanged", forward.check_input_unchanged, (), "input_kept"),
    Check("grad_input", gradients.check_grad_input, GRADS, None),
    Check("grad_params", gradients.check_grad_params, GRADS, None),
    Check("train_state", safety.check_train_state, GRADS, "train_safe"),
    Check("residual", gradients.check_residual, ("shape",) + GRADS, None),
    Check("batch", batch.check_batch, COMPARES + GRADS, "independent"),
    Check("padding", mixing.check_padding, COMPARES + GRADS + ("independent",), None),
    Check("causal", mixing.check_causal, COMPARES + GRADS, None),
    Check("order", order.check_order, COMPARES + GRADS, None),
    Check("copy", safety.check_copy, (), "copyable"),
    Check("train_eval", structure.check_train_eval, COMPARES + ("train_safe", "copyable"), None),
    Check("dropout", dropout.check_dropout, COMPARES + ("train_safe", "copyable"), None, slow=True),
    Check("attention", attention.check_attention, ("finite",), None),
    Check("kv_cache", attention.check_kv_cache, COMPARES, None, slow=True),
    Check("norm_placement", structure.check_norm_placement, ("finite",), None),
    Check("need_weights", forward.check_need_weights, (), None),
    Check("dtype", forward.check_dtype, COMPARES + ("copyable",), None, slow=True),
    Check("ffn_share", structure.check_ffn_share, (), None),
    Check("tensor_parallel", check_tensor_parallel, COMPARES + GRADS, None),
    Check("fsdp", check_fsdp, COMPARES + GRADS + ("independent",), None),
    Check("reference", structure.check_reference, ("shape", "deterministic"), None),
    Check("norms", norms.check_norms, ("finite", "copyable"), None),
    Check("relative", alignment.check_relative, ("finite",), None),
    Check("position_bias", positions.check_position_bias, ("finite",), None),
    Check("names", naming.check_names, (), None),
    Check("spec", claims.check_spec, (), None),
    Check("like_reference", claims.check_like_reference, ("shape",), None),
    Check("derivative", training.check_derivative, ("finite", "input_kept", "train_safe", "copyable"), None, slow=True),
    Check("checkpointing", checkpointing.check_checkpointing, GRADS + ("train_safe",), None, slow=True),
    Check("meta_init", lifecycle.check_meta_init, ("finite", "deterministic"), None, slow=True),
    Check("state_dict", lifecycle.check_state_dict, ("finite", "deterministic"), None, slow=True),
    Check("precision", precision.check_precision, ("finite", "deterministic"), None, slow=True),
    Check("optimizer_step", optimizer.check_optimizer_step, GRADS + ("train_safe", "copyable"), None, slow=True,
          as_built=True),
    Check("grad_accumulation", accumulation.check_grad_accumulation, ("shape",) + GRADS + ("train_safe",), None, slow=True),
    Check("history", lifecycle.check_history, ("finite", "deterministic"), None, slow=True),
    Check("device", device.check_device, ("shape",), None),
    Check("global_state", globalstate.check_global_state, (), None),
)
CHECK_NAMES = tuple(c.name for c in REGISTRY)


@contextmanager
def plain_bool_checks():
    """torch._check_with short-circuited for a plain True: torch imports sympy (through
    torch.fx.experimental.symbolic_shapes, ~1 s, a third of check's run at its defaults) on its first call,
    only to evaluate symbolic conditions. nn.MultiheadAttention makes that call for a key_padding_mask
    whenever grad is on. A symbolic or false condition goes to torch's own function; restored on exit."""
    original = torch._check_with

    def check_with(error_type, cond, message=None):
        if cond is True:
            return None
        return original(error_type, cond, message)

    torch._check_with = check_with
    try:
        yield
    finally:
        torch._check_with = original


def docs_table() -> str:
    """The table of checks in docs/checks.md, from the registry (a test keeps the two equal)."""
    rows = ["| check | what it catches | needs |", "|---|---|---|"]
    rows += [f"| `{c.name}` | {c.catches} | {', '.join(NEEDS[n] for n in c.needs)} |" for c in REGISTRY]
    return "\n".join(rows)


def check_names(names, flag: str) -> tuple[str, ...]:
    """Check names from a comma-separated string or an iterable, each one in the registry (else a ConfigError
    naming the close matches)."""
    import difflib

    if isinstance(names, str):
        names = names.split(",")
    names = tuple(n.strip() for n in names if n.strip())
    for n in names:
        if n not in CHECK_NAMES:
            close = difflib.get_close_matches(n, CHECK_NAMES, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"{flag}: no check named {n!r}; {hint}checks: {', '.join(CHECK_NAMES)}")
    return names


def select(only=None, skip=None, fast: bool = False) -> tuple[str, ...] | None:
    """The checks to run: --only NAMES, minus --skip NAMES, minus the slow ones under --fast (None: all). --fast
    leaves out the slow checks nobody named: a check named in --only runs. Nothing left is a ConfigError (an empty
    table that says OK checked nothing)."""
    if only is None and skip is None and not fast:
        return None
    chosen = check_names(only, "--only") if only is not None else CHECK_NAMES
    if only is not None and not chosen:
        raise ConfigError(f"--only {only if isinstance(only, str) else ','.join(map(str, only))!r} names no check; "
                          f"checks: {', '.join(CHECK_NAMES)}")
    slow = {c.name for c in REGISTRY if c.slow} if fast and only is None else set()
    skipped = set(check_names(skip, "--skip") if skip is not None else ())
    left = tuple(n for n in chosen if n not in skipped | slow)
    if not left:
        said = [f for f, on in (("--only", only is not None), ("--skip", skip is not None), ("--fast", fast)) if on]
        raise ConfigError(f"no check selected: {' and '.join(said)} leave(s) out every check; name at least one to run")
    return left


def run_checks(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *,
               strict: bool = False, progress: Callable[[str, str | None], None] | None = None, run: RunInfo | None = None,
               only: tuple[str, ...] | None = None, sharding=None, declaration=None, noted=()) -> CheckReport:
    """Run the battery; a check that raises becomes `error` and the rest still run; unmet needs skip.
    progress(check, detail) hears each check as it starts (detail None) and the long ones' probes. noted: (when,
    {switch: [before, after]}) of torch's process-wide switches the block changed before the battery (its build)."""
    ctx = Context(subject, cfg, device, dtype, sharding=sharding, progress=progress, declaration=declaration)
    ctx.state_changes.extend(noted)
    with plain_bool_checks(), runtime.compiled_run_eagerly():
        return _run(ctx, strict, run, only)


def _run(ctx: Context, strict: bool, run: RunInfo | None, only: tuple[str, ...] | None) -> CheckReport:
    counter = PassCounter(ctx.subject)
    module = ctx.subject.module
    chosen = [c for c in REGISTRY if only is None or c.name in only]
    zeros = hiding_zeros(module) if not all(c.as_built for c in chosen) else []
    if zeros and run is not None:
        built = [c.name for c in chosen if c.as_built]
        tail = f"; {', '.join(built)} judged them as built" if built else ""
        run = replace(run, warnings=run.warnings + (zeros_note(zeros, "the checks ran", tail),))
    try:
        with drawn_at_random(module, zeros):
            return _battery(ctx, strict, run, only, counter, zeros)
    finally:
        counter.close()


def _battery(ctx: Context, strict: bool, run: RunInfo | None, only: tuple[str, ...] | None,
             counter: PassCounter, zeros: list[str]) -> CheckReport:
    results = []
    raised: dict[str, str] = {}  # the checks that raised, with their error
    gapped: dict[str, str] = {}  # the checks that met a backward this device lacks (Subject.backward_gap)
    battery_started = time.perf_counter()
    switches = globalstate.snapshot()
    if only is None or "input_unchanged" in only:  # what its forwards must leave as they find it
        ctx.params_at_start = fingerprint(ctx.subject.module)
    if only is None or "train_state" in only:  # what must still train after its eval and train switches
        built = ctx.subject.trained_at_build  # noted before tblock's first forward, where the subject was loaded
        ctx.trained_at_start = set(built) if built is not None else {
            n for n, p in ctx.subject.module.named_parameters() if p.requires_grad}
    for check in REGISTRY:
        if only is not None and check.name not in only:
            continue
        ctx.current = check.name
        if ctx.progress:
            ctx.progress(check.name, None)
        unmet = next((n for n in check.needs if n in ctx.unmet), None)
        if unmet:  # where the check that establishes it raised, that is the reason: its need is not known broken
            by = ctx.unmet[unmet]
            kind, facts = (("needs.backward", {"check": by, "error": gapped[by]}) if by in gapped
                           else ("needs.raised", {"check": by, "error": raised[by]}) if by in raised
                           else (f"needs.{unmet}", {"check": by}))
            results.append(CheckResult(check.name, Status.SKIP, None, kind, facts, 0.0, Passes()))
            continue
        # A family known to break a rule on purpose (an hf:TYPE subject's `by_design`): that check skips, or passes
        # with the reason. Read from tblock's wrapper, never from the module under test.
        design = ctx.subject.by_design
        if check.name + ".skip" in design:
            results.append(CheckResult(check.name, Status.SKIP, None, "by_design.skip", {"reason": design[check.name + ".skip"]},
                                       0.0, Passes()))
            continue
        started, before = time.perf_counter(), counter.now()
        wanted = ctx.subject.backward_gap[1] if ctx.subject.backward_gap else 0
        try:
            with as_built(ctx.subject.module, zeros) if check.as_built else nullcontext():
                outcome = check.function(ctx)
        except USER_ERRORS as e:  # the block under test raised (sys.exit included); report it, go on
            if is_out_of_memory(e):
                raise
            outcome = Outcome(Status.ERROR, "error.raised", None, {"error": one_line(e)})
        if outcome.status in (Status.WARN, Status.FAIL) and outcome.kind in design:
            outcome = Outcome(Status.PASS, "by_design", outcome.value, {**outcome.facts, "rule": outcome.kind,
                                                                        "reason": design[outcome.kind]})
        gap = ctx.subject.backward_gap
        if gap and (gap[1] > wanted or outcome.status is Status.ERROR):  # gradients this device cannot give: not judged
            gapped[check.name] = gap[0]
            outcome = Outcome(Status.SKIP, "needs.backward", None, {"check": check.name, "error": gapped[check.name]},
                              unmet=True)
        if outcome.status is Status.ERROR:
            raised[check.name] = outcome.facts.get("error", outcome.kind)
        if check.establishes:
            broken = outcome.unmet if outcome.unmet is not None else outcome.status in (Status.FAIL, Status.ERROR)
            if broken:
                ctx.unmet[check.establishes] = check.name
            else:
                ctx.met.add(check.establishes)
        now = globalstate.snapshot()
        if now != switches:  # the block changed torch's process-wide state: noted for global_state, put back
            ctx.state_changes.append((check.name, globalstate.changes(switches, now)))
            globalstate.restore(switches)
        results.append(CheckResult(check.name, outcome.status, outcome.value, outcome.kind, outcome.facts,
                                   round(time.perf_counter() - started, 4), counter.now() - before))
    return CheckReport(tuple(results), strict, run, round(time.perf_counter() - battery_started, 4), counter.now())
