"""The battery: every check declared once (name, function, needs, what it establishes, what it catches), and the runner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from tblock_cli.checks import (
    attention,
    checkpointing,
    claims,
    forward,
    gradients,
    lifecycle,
    mixing,
    naming,
    norms,
    positions,
    precision,
    safety,
    structure,
    training,
)
from tblock_cli.checks.context import Context
from tblock_cli.checks.cost import PassCounter, Passes
from tblock_cli.checks.result import CheckReport, CheckResult, Outcome
from tblock_cli.checks.sharded import check_fsdp, check_tensor_parallel
from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, ConfigError, is_out_of_memory, one_line
from tblock_cli.probes import plain_bool_checks
from tblock_cli.report import RunInfo, Status
from tblock_cli.subject import Subject

# What a need means, as the docs table names it.
NEEDS = {"shape": "shape", "finite": "finite", "deterministic": "deterministic", "input_kept": "input kept",
         "independent": "independent samples", "train_safe": "repeatable training step", "copyable": "faithful deepcopy"}
COMPARES = ("shape", "finite", "deterministic")  # checks that compare two forwards of random inputs
GRADS = ("finite", "input_kept")  # checks that take a gradient through the block


@dataclass(frozen=True)
class Check:
    """One check: its name, its function, the needs it waits for, the need it establishes, what it catches (docs)."""

    name: str
    run: Callable[[Context], Outcome]
    needs: tuple[str, ...] = ()
    establishes: str | None = None  # left unmet when the check fails or errors (or says so in its outcome)
    catches: str = ""
    slow: bool = False  # left out by --fast: its cost is many forwards of the block (see docs/performance.md)


REGISTRY: tuple[Check, ...] = (
    Check("shape", forward.check_shape, (), "shape", "an output not of the input's (B, T, d) shape (batch and seq kept different so a (T, B) mix-up shows); an output dtype other than the input's is a **warning** (something upcasts or downcasts)"),
    Check("finite", forward.check_finite, (), "finite", "NaN/inf on random, constant-token (zero variance), zero and large inputs; each norm with `eps=0` alone on a zero-variance input"),
    Check("determinism", forward.check_determinism, ("finite",), "deterministic", "two eval forwards that differ beyond rounding (dropout in eval, noise, state that changes the output), also in a copy with its zero dropout probabilities raised to 0.1 (dropout applied in eval, hidden by a default of 0)"),
    Check("input_unchanged", forward.check_input_unchanged, (), "input_kept", "the caller's tensor changed in place, in eval or train"),
    Check("grad_input", gradients.check_grad_input, GRADS, None, "no gradient, a non-finite or an all-zero gradient at the input (detach, no_grad)"),
    Check("grad_params", gradients.check_grad_params, GRADS, None, "a parameter with no gradient (unused, under `no_grad`, detached); zero gradients are a note (a key bias can legitimately get one)"),
    Check("train_state", safety.check_train_state, GRADS, "train_safe", "a second train forward + backward that fails (module state written in a training forward keeps the first graph); tensors the module keeps that carry autograd history are a **warning**"),
    Check("residual", gradients.check_residual, ("shape",) + GRADS, None, "no identity path: tr(J)/n < 0.5 (Pre-LN ~1.0, Post-LN ~0.9, none ~0), per layer for built-in stacks; the identity counted twice (> 1.5); a residual taken after the norm (doubling the input leaves the output unchanged)"),
    Check("batch", mixing.check_batch, COMPARES + GRADS, "independent", "a sample alone differs from itself in the batch (eval), or sample 0's output has a gradient w.r.t. other samples (train: BatchNorm, a batch mean)"),
    Check("padding", mixing.check_padding, COMPARES + GRADS + ("independent",), None, "padded inputs that reach real outputs (values in eval, gradients in train); and the real positions of a padded batch that differ from the same tokens run alone, with right padding, and with left padding for causal blocks (declared or causal by themselves) without positions inside"),
    Check("causal", mixing.check_causal, COMPARES + GRADS, None, "with `--causal`: outputs up to t that move when inputs after t change, or have a gradient w.r.t. them"),
    Check("order", mixing.check_order, COMPARES + GRADS, None, "without `--causal`: permuted tokens in must give the same outputs permuted out; a failure is a **warning** (heads merged without transposing back, a roll or shift)"),
    Check("copy", safety.check_copy, (), "copyable", "a `deepcopy` that is not faithful: the copy's forward calls the original's modules or reads its parameters (a closure or a lambda capturing a submodule), or the copy raises"),
    Check("train_eval", structure.check_train_eval, COMPARES + ("train_safe", "copyable"), None, "parameters a train backward reaches that an eval backward never touches; with every dropout zeroed (the block rebuilt through its constructor with `dropout=0` where it takes one), a train-mode forward that differs from the eval forward (an eval-only path), unless a second train forward shows training itself random"),
    Check("attention", attention.check_attention, ("finite",), None, "per attention call: logit std, entropy relative to uniform, mean max probability; fails on a softmax over the query axis; **warns** when the scores look unscaled or scaled more than 1/sqrt(d_head), when no token attends to itself (a masked diagonal), and when a q.k product weights the values with no softmax (a softmax written out by hand, rows non-negative and summing to 1, counts as one)"),
    Check("kv_cache", attention.check_kv_cache, COMPARES, None, "with `--causal` and a `decode` method: cached decoding that differs from the full forward; a graph growing across steps; caches that share state ([decoding.md](decoding.md))", slow=True),
    Check("norm_placement", structure.check_norm_placement, ("finite",), None, "in a block with norms of its residual stream: an FFN that reads the stream with no norm before it, attention that does while no norm follows the add (a missing norm, or Pre- and Post-LN mixed in one block), keys/values that skip the norm the queries get: **warnings**; every sublayer reading the raw stream with its output normalised before the add (OLMo-2's placement) passes"),
    Check("need_weights", forward.check_need_weights, (), None, "`nn.MultiheadAttention` called with `need_weights=True` (its weights computed and dropped): a **warning** with the bytes"),
    Check("dtype", forward.check_dtype, COMPARES + ("copyable",), None, "the run's dtype differs from a float64 copy beyond its tolerance (relative RMS 2e-6, 5e-3, 4e-2)", slow=True),
    Check("ffn_share", structure.check_ffn_share, (), None, "the FFN's share from dataflow roles against what its matrices predict; **warns** on a linear FFN (two projections with no nonlinearity) and on parameters outside attention, FFN and norms (> 1 %)"),
    Check("tensor_parallel", check_tensor_parallel, COMPARES + GRADS, None, "with `--tp N`: outputs, input gradients or full parameter gradients of the block sharded by PyTorch's `parallelize_module` (plan from the dataflow roles, or `--tp-plan`) that differ from the unsharded block with the same weights; names the first module whose output differs ([distributed.md](distributed.md))"),
    Check("fsdp", check_fsdp, COMPARES + GRADS + ("independent",), None, "with `--fsdp N`: under `fully_shard`, each rank its own micro-batch, gradients that differ from one process's on the whole batch (averaged as FSDP reduces them), or parameters that differ after the same optimizer step"),
    Check("reference", structure.check_reference, ("shape", "deterministic"), None, "the built-in block against `nn.TransformerEncoderLayer` with copied weights (1e-5, float32)"),
    Check("norms", norms.check_norms, ("finite", "copyable"), None, "each norm alone: relative RMS error against its float64 copy at input RMS 1e3 (an fp16 RMSNorm squaring before it upcasts returns 0: error 1.0; limit 0.1 half, 1e-4 float32); a `(1 + w)` norm whose output RMS at init exceeds 1.5 (w initialised to 1 doubles it)"),
    Check("relative", positions.check_relative, ("finite",), None, "with every token identical, attention scores (each row taken relative to its own diagonal) that are not a function of i - j: a rotary cos/sin layout that does not match its rotation, rotary angles computed in half precision (probed at 320 tokens in fp16/bf16); blocks whose positions enter before the q/k projections (absolute) are skipped"),
    Check("position_bias", positions.check_position_bias, ("finite",), None, "an additive bias linear in distance (ALiBi) that rises with distance or whose slopes are not geometric; slopes geometric but not the paper's set are a **warning**; a learned (non-linear) bias is not judged; where `relative`'s identical-token scores are a multiple of their q.k product (no bias), no probe of its own"),
    Check("names", naming.check_names, (), None, "conventional names that contradict dataflow roles (gate/up/down, q/k/v/o, w2/w3, wq/wk/wv): a **warning** naming both; a gated FFN whose activation follows the product (`act(gate * up)`): a **warning**"),
    Check("spec", claims.check_spec, (), None, "with `--like hf:TYPE` or `--expect KEY=VALUE`: a spec card entry (rotary base, dims and scaling, score scale, soft-cap, window, activation, eps, norm offset, q/k-norm axis, residual form and gains, MoE routing; [spec.md](spec.md)) that differs from the declaration, each named with both values; skips when nothing is declared"),
    Check("like_reference", claims.check_like_reference, ("shape",), None, "with `--like hf:TYPE`: the block against that Hugging Face layer with its weights carried (as `tblock compare` carries them): outputs or gradients that differ, the first differing component named; skips where the weights cannot be carried"),
    Check("derivative", training.check_derivative, ("finite", "input_kept", "train_safe", "copyable"), None, "a gradient that is finite but not the derivative: autograd's directional derivative against central finite differences (float64 copy, train mode, dropout active, RNG reseeded before every evaluation) along 2 random directions (input and parameters jointly, input alone), the median of steps 1e-2, 3e-3, 1e-3 more than 1e-6 and 30x their own spread away from autograd (differences that agree with each other, not with autograd; a kink or a float32 island makes them disagree); names the worst tensor (a custom backward, a `.detach()` or `.data` on a path, a recompute with other dropout masks)", slow=True),
    Check("checkpointing", checkpointing.check_checkpointing, GRADS + ("train_safe",), None, "non-reentrant activation checkpointing (as `torch.utils.checkpoint(use_reentrant=False)` does it) around the block, and the block's own switch (Hugging Face's, a `use_checkpoint`/`checkpoint`/`grad_checkpointing` flag or keyword), that change outputs, input or parameter gradients with dropout active and the same seed; parameters that get no gradient when the input does not require one (reentrant checkpointing inside)", slow=True),
    Check("meta_init", lifecycle.check_meta_init, ("finite", "deterministic"), None, "built on the meta device, `to_empty()`, then its own init (`reset_parameters`, a declared `init_weights`, the family's `_init_weights` for `hf:`): a buffer that differs from a normal build's (a rotary `inv_freq` registered `persistent=False` and computed in `__init__`), or outputs that differ with the normal build's weights loaded; skipped where its own init leaves parameters unset (no deferred init to judge) and for a module handed over as an instance", slow=True),
    Check("state_dict", lifecycle.check_state_dict, ("finite", "deterministic"), None, "a fresh instance (another seed) loaded with the block's `state_dict` whose outputs differ, missing or unexpected keys, parameters hidden in a Python list; tensors the forward reads that are plain attributes (not moved by `.to()`, not saved) are a **warning**", slow=True),
    Check("precision", precision.check_precision, ("finite", "deterministic"), None, "under `torch.autocast` (bfloat16) and after `.to(bfloat16)`, any component's or the output's error against float32 at 768 tokens (after `.to`: float32 with the same bfloat16-rounded weights and buffers), the 75th percentile over positions of each position's relative error, above 0.1; names the first such component (rotary positions or angles computed in bfloat16)", slow=True),
    Check("optimizer_step", training.check_optimizer_step, GRADS + ("train_safe", "copyable"), None, "one AdamW step (lr 1e-4) on a fixed regression target that does not lower the loss or leaves a parameter with a gradient unchanged; two distinct parameters holding the same random values (a tie broken by a copy); parameters with `requires_grad=False` are a **warning** (a norm weight frozen by mistake)", slow=True),
)
CHECK_NAMES = tuple(c.name for c in REGISTRY)


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
               only: tuple[str, ...] | None = None, sharding=None, declaration=None) -> CheckReport:
    """Run the battery; a check that raises becomes `error` and the rest still run; unmet needs skip.
    progress(check, detail) hears each check as it starts (detail None) and the long ones' probes."""
    with plain_bool_checks():
        return _run(Context(subject, cfg, device, dtype, sharding=sharding, progress=progress, declaration=declaration),
                    strict, run, only)


def _run(ctx: Context, strict: bool, run: RunInfo | None, only: tuple[str, ...] | None) -> CheckReport:
    counter = PassCounter(ctx.subject)
    try:
        return _battery(ctx, strict, run, only, counter)
    finally:
        counter.close()


def _battery(ctx: Context, strict: bool, run: RunInfo | None, only: tuple[str, ...] | None,
             counter: PassCounter) -> CheckReport:
    results = []
    battery_started = time.perf_counter()
    for check in REGISTRY:
        if only is not None and check.name not in only:
            continue
        ctx.current = check.name
        if ctx.progress:
            ctx.progress(check.name, None)
        unmet = next((n for n in check.needs if n in ctx.unmet), None)
        if unmet:
            results.append(CheckResult(check.name, Status.SKIP, None, f"needs.{unmet}", {"check": ctx.unmet[unmet]}, 0.0, Passes()))
            continue
        # A family known to break a rule on purpose (an hf:TYPE subject's `by_design`): that check skips, or passes
        # with the reason. Read from tblock's wrapper, never from the module under test.
        design = ctx.subject.by_design
        if check.name + ".skip" in design:
            results.append(CheckResult(check.name, Status.SKIP, None, "by_design.skip", {"reason": design[check.name + ".skip"]},
                                       0.0, Passes()))
            continue
        started, before = time.perf_counter(), counter.now()
        try:
            outcome = check.run(ctx)
        except USER_ERRORS as e:  # the block under test raised (sys.exit included); report it, go on
            if is_out_of_memory(e):
                raise
            outcome = Outcome(Status.ERROR, "error.raised", None, {"error": one_line(e)})
        if outcome.status in (Status.WARN, Status.FAIL) and outcome.kind in design:
            outcome = Outcome(Status.PASS, "by_design", outcome.value, {**outcome.facts, "rule": outcome.kind,
                                                                        "reason": design[outcome.kind]})
        if check.establishes:
            broken = outcome.unmet if outcome.unmet is not None else outcome.status in (Status.FAIL, Status.ERROR)
            if broken:
                ctx.unmet[check.establishes] = check.name
            else:
                ctx.met.add(check.establishes)
        results.append(CheckResult(check.name, outcome.status, outcome.value, outcome.kind, outcome.facts,
                                   round(time.perf_counter() - started, 4), counter.now() - before))
    return CheckReport(tuple(results), strict, run, round(time.perf_counter() - battery_started, 4), counter.now())
