"""Checks of one forward's health: shape and dtype kept, finite outputs, determinism, the input left alone,
need_weights off, and agreement with a float64 copy."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from tblock_cli.anatomy.mha import attention_modules, attention_weights_bytes, mha_call_arguments
from tblock_cli.checks.context import TRAINING_INPUT, Context, eval_forward
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.checks.streamed import float64_streamed
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import cast, changed, f64, module_copy, rel_diff, state_key, tensors, train_mode
from tblock_cli.report import Status
from tblock_cli.runtime import dtype_name
from tblock_cli.subject.through import raised_before_layer

# Relative RMS error against a float64 copy that is still "agreeing": measured on the built-in
# block at d_model 512 as ~2e-7 (float32), ~5e-4 (float16) and ~4e-3 (bfloat16); 10x margin.
DTYPE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def check_shape(ctx: Context) -> Outcome:
    """Catches: an output not of the input's (B, T, d) shape (batch and seq kept different so a (T, B) mix-up shows),
    also for a one-token sequence (a `squeeze()` that drops the length); a forward that raises on one token is a
    **warning** (not where it raises one token longer too: a block of one length, a patch grid); an output in float64
    from an input that is not (a NumPy table, float64 by default, in the arithmetic: the next layer's weights refuse
    it); any other output dtype than the input's is a **warning** (something upcasts or downcasts)"""
    B, T = ctx.cfg.batch, ctx.cfg.seq
    if B == T:  # a (T, B) mix-up cannot show when B == T
        x = ctx.x(B, T + 1)
        out = eval_forward(ctx, x)
    else:
        x, out = ctx.standard()
    if out.shape != x.shape:
        return failed("shape.changed", list(out.shape), input=list(x.shape), output=list(out.shape))
    one = _one_token(ctx)
    if one is not None and one.status is not Status.PASS:
        return one
    if out.dtype == torch.float64 and x.dtype != torch.float64:
        return failed("shape.float64", list(out.shape), input_dtype=dtype_name(x.dtype), output_dtype=dtype_name(out.dtype))
    if out.dtype != x.dtype:
        kind = "shape.upcast" if out.dtype.itemsize > x.dtype.itemsize else "shape.downcast"
        return warned(kind, list(out.shape), input_dtype=dtype_name(x.dtype), output_dtype=dtype_name(out.dtype))
    return one or passed("shape.kept", list(out.shape))


def _one_token(ctx: Context) -> Outcome | None:
    """A one-token sequence's outcome where it is not the input's shape, or raises; None where it is, or where the
    model driving a layer refuses it before the layer runs (through.raised_before_layer). The need the shape check establishes
    (every other check's sequences) stays met."""
    x = ctx.x(ctx.cfg.batch, 1)
    ctx.step("one token")
    try:
        out = eval_forward(ctx, x)
    except Exception as e:  # noqa: BLE001 - the block's own error, reported
        if is_out_of_memory(e):
            raise
        if raised_before_layer(e):  # the model around a driven layer refuses one token, not the layer
            return None
        if _fixed_length(ctx):  # a patch grid (BEiT, EVA) or a table of one size: one token is no length it takes
            return replace(passed("shape.fixed_length", None, seq=ctx.cfg.seq, error=one_line(e)), unmet=False)
        return replace(warned("shape.one_token_raises", None, error=one_line(e)), unmet=False)
    if out.shape != x.shape:
        return replace(failed("shape.one_token", list(out.shape), input=list(x.shape), output=list(out.shape)),
                       unmet=False)
    return None


def _fixed_length(ctx: Context) -> bool:
    """Whether the block raises one token longer than its standard input, as on one token: it takes one length only."""
    try:
        eval_forward(ctx, ctx.x(ctx.cfg.batch, ctx.cfg.seq + 1 + (ctx.cfg.batch == ctx.cfg.seq + 1)))
    except Exception as e:  # noqa: BLE001 - the block's own error: the length is the block's
        if is_out_of_memory(e):
            raise
        return True
    return False


def check_determinism(ctx: Context) -> Outcome:
    """Catches: two eval forwards that differ beyond rounding (dropout in eval, noise, state that changes the output),
    also in a copy with its zero dropout probabilities raised to 0.1 (dropout applied in eval, hidden by a default
    of 0); an eval forward that writes other values into the module's buffers or tensor attributes at every call, or
    adds tensors to them, while its output does not show it (running statistics updated in eval, a list that grows),
    or registers hooks that stay, more at every call (a hook added inside the forward: calls grow slower and memory
    grows): a **warning**"""
    x, a = ctx.standard()
    module = ctx.subject.module
    key, hooks = state_key(module), hooks_held(module)
    b = eval_forward(ctx, x)
    if torch.equal(a, b):
        if hooks_added(hooks, hooks_held(module)):  # once (a lazy set-up) or at every call?
            hooks = hooks_held(module)
            eval_forward(ctx, x)
            if added := hooks_added(hooks, hooks_held(module)):
                return warned("determinism.adds_hooks", sum(added.values()), added=added)
        if state_key(module) != key:  # written: a cache filled once (a rotary table for this length) or every call?
            grown, written = eval_writes(ctx, x)
            if grown or written:
                return warned("determinism.writes_state", len(grown) + len(written), grown=grown, written=written)
        return dropout_raised(ctx, x)
    diff = rel_diff(a, b)
    if diff <= ctx.tol:
        return warned("determinism.rounding", diff, diff=diff)
    return failed("determinism.random", diff, diff=diff)


def hooks_held(module: nn.Module) -> dict[str, int]:
    """How many hooks each module holds (forward, backward, state-dict: every hook dict nn.Module keeps), by path, and
    torch's global module hooks under "(global)"."""
    from torch.nn.modules import module as base

    from tblock_cli.checks.training import all_modules

    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
    count = lambda holder: sum(len(v) for k, v in vars(holder).items() if k.endswith("hooks") and isinstance(v, dict))
    held = {names.get(id(m)) or type(m).__name__: count(m) for m in all_modules(module)}
    held["(global)"] = count(base)
    return held


def hooks_added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The hooks a call left behind, by path."""
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def held_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers and plain tensor attributes (in lists, tuples and dicts too), and those of modules it
    keeps as attributes (an HF layer's model), by path; parameters are not state a forward should write."""
    held, seen, todo = {}, set(), [("", module)]
    while todo:
        prefix, m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for name, t in m._buffers.items():
            if t is not None:
                held[prefix + name] = t
        todo += [(f"{prefix}{n}.", c) for n, c in m._modules.items() if c is not None]
        for name, value in vars(m).items():
            if name.startswith("_"):
                continue
            if isinstance(value, nn.Module):
                todo.append((f"{prefix}{name}.", value))
            elif isinstance(value, (torch.Tensor, list, tuple, dict)):
                for i, t in enumerate(tensors(value)):
                    held[f"{prefix}{name}[{i}]" if not isinstance(value, torch.Tensor) else prefix + name] = t
    return held


def eval_writes(ctx: Context, x: torch.Tensor) -> tuple[list[str], list[str]]:
    """One more eval forward of x, after one that wrote module state: the paths it adds (or drops), and those whose
    values it changes. A cache filled for this input (a rotary table, a KV cache written at the same positions)
    holds the same values again: neither."""
    before = {p: t.detach().clone() for p, t in held_tensors(ctx.subject.module).items() if not t.is_meta}
    eval_forward(ctx, x)
    after = {p: t for p, t in held_tensors(ctx.subject.module).items() if not t.is_meta}
    grown = sorted(set(after) ^ set(before))
    written = [p for p, t in after.items() if p in before and not _same(t.detach(), before[p])]
    return grown, written


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaN equal to NaN (a cache initialised with NaN holds it again)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def dropout_raised(ctx: Context, x: torch.Tensor) -> Outcome:
    """Eval forwards with the block's zero dropout probabilities raised to 0.1 (in place, put back after) must stay
    identical: a block built with dropout 0 (its constructor takes none) would otherwise hide a dropout applied in
    eval."""
    from tblock_cli.checks.structure import raise_dropout

    with raise_dropout(ctx.subject.module) as raised:
        if not raised:
            return passed("determinism.identical", 0.0)
        diff = rel_diff(eval_forward(ctx, x), eval_forward(ctx, x))
    if diff > ctx.tol:
        return failed("determinism.raised_dropout", diff, diff=diff, raised=raised)
    return passed("determinism.identical", 0.0, raised=raised)


def fingerprint(module: nn.Module) -> dict[str, tuple[float, float]]:
    """Each trainable parameter's sum and norm (accumulated in float32, float64 for float64 ones): equal for the same
    values (the same reductions, on the same threads), moved by any write that changes them beyond float32's rounding
    of the sum: a normalisation, a standardisation, a clamp, a decay. Frozen parameters are left out (a router's
    balancing bias that a rule updates is a buffer in all but name), and so is an nn.Embedding with max_norm: torch
    renormalises its looked-up rows in place by design."""
    skip = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding) and m.max_norm is not None}
    out = {}
    with torch.no_grad():
        for n, p in module.named_parameters():
            if id(p) in skip or not p.requires_grad or type(p.data) is not torch.Tensor or p.is_meta or \
                    not p.is_floating_point():
                continue
            acc = torch.float64 if p.dtype == torch.float64 else torch.float32  # float64 reductions: 25x slower here
            out[n] = (torch.sum(p, dtype=acc).item(), torch.linalg.vector_norm(p, dtype=acc).item())
    return out


def check_input_unchanged(ctx: Context) -> Outcome:
    """The standard eval forward and the training step (both shared with other checks) leave their input alone, and
    the block's parameters as the battery found them.

    Catches: the caller's tensor changed in place, in eval or train; a forward that writes the block's own trainable
    parameters, a **warning** (a weight standardised or normalised in place instead of on a copy: its gradient misses
    the normalisation, and the optimizer steps a weight the next forward replaces)"""
    from tblock_cli.checks.gradients import train_backward

    changed_eval = ctx.standard_forward().changed_input
    if changed_eval[0]:
        return failed("input_unchanged.eval", changed_eval[1])
    try:
        train_backward(ctx)
    except Exception as e:  # noqa: BLE001 - a backward that raises is grad_input's to report; its forward is read below
        if is_out_of_memory(e):
            raise
    changed_train = ctx.noted(TRAINING_INPUT)
    if changed_train is None:  # the training forward itself raised: it raises here again, as the error
        x = ctx.x()
        before = x.clone()
        with train_mode(ctx.subject.module, True), torch.enable_grad():
            ctx.subject(x)
        changed_train = changed(x, before)
    if changed_train[0]:
        return failed("input_unchanged.train", changed_train[1])
    now = fingerprint(ctx.subject.module)
    written = [n for n, f in ctx.params_at_start.items() if n in now and now[n] != f]
    if written:  # a warning: a clamp or a normalisation kept in place is some designs' choice; the input was kept
        return warned("input_unchanged.parameters", len(written), parameters=written[:8])
    return passed("input_unchanged.kept", 0.0)


def check_need_weights(ctx: Context) -> Outcome:
    """Catches: `nn.MultiheadAttention` called with `need_weights=True` (its weights computed and dropped): a
    **warning** with the bytes"""
    mhas = attention_modules(ctx.subject.module)
    if not mhas:
        return skipped("need_weights.no_mha")
    calls: list[tuple[str, bool, int]] = []

    def recorder(name):
        def hook(mha, args, kwargs):
            bound = mha_call_arguments(mha, args, kwargs)
            calls.append((name, bool(bound.arguments["need_weights"]), attention_weights_bytes(mha, bound)))
        return hook

    hooks = [m.register_forward_pre_hook(recorder(n), with_kwargs=True) for n, m in mhas]
    try:
        eval_forward(ctx, ctx.x())
    finally:
        for h in hooks:
            h.remove()
    if not calls:
        return skipped("need_weights.not_called")
    on = [(n, b) for n, nw, b in calls if nw]
    if on:
        wasted = sum(b for _, b in on)
        return warned("need_weights.on", wasted, modules=sorted({n or "(root)" for n, _ in on}), bytes=wasted)
    return passed("need_weights.off", 0, calls=len(calls))


def float64_reference(ctx: Context, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The block's eval output on x computed in float64: streamed through the block's own modules, sublayer by
    sublayer (checks/streamed.py float64_streamed); a whole float64 copy where streaming cannot run the block."""
    module = ctx.subject.module
    x64 = x.to(device=device, dtype=torch.float64)
    try:
        with float64_streamed(module, device), train_mode(module, False), torch.no_grad():
            return ctx.subject(x64.clone())
    except Exception:  # noqa: BLE001 - a tensor read where its module is not called: the whole copy runs it
        pass
    ref_module = cast(module_copy(module), torch.float64, device)
    with train_mode(ref_module, False), torch.no_grad():
        return ctx.subject.like(ref_module)(x64)


def narrowed_inside(ctx: Context) -> tuple:
    """In a float32 run, the calls of the traced forward that cast an activation (a tensor reading the block's input)
    to float16 or bfloat16: half precision written into the code, whatever dtype the block runs in; () in a
    half-precision run, or where the trace does not run (other checks report that forward)."""
    if ctx.dtype != torch.float32:
        return ()
    try:
        return ctx.dataflow().narrowed
    except Exception as e:  # noqa: BLE001 - the trace's own error is the dataflow readers' to report
        if is_out_of_memory(e):
            raise
        return ()


def check_dtype(ctx: Context) -> Outcome:
    """Catches: the run's dtype differs from a float64 copy beyond its tolerance (relative RMS 2e-6, 5e-3, 4e-2); a
    block built with some trainable parameters narrower than the rest (a bfloat16 gain among float32 weights: tblock's
    cast to the run's dtype hides it; trained as built, its gradient and updates round, and FSDP2 refuses a module
    of mixed parameter dtypes); in a float32 run, an activation cast to float16 or bfloat16 inside the forward (scores
    `.half()`ed before the softmax, an autocast the block enters itself): half precision written into the code, which
    the float64 copy repeats, so the comparison cannot show it"""
    if ctx.subject.narrow_at_build is not None:  # read as built: no forward needed
        block, params = ctx.subject.narrow_at_build
        return failed("dtype.narrow_at_build", len(params), params=params, block=block, dtype=dtype_name(ctx.dtype))
    narrowed = narrowed_inside(ctx)
    if narrowed:
        module, call, wide, half = narrowed[0]
        return failed("dtype.narrowed", len(narrowed), dtype=dtype_name(ctx.dtype), module=module, call=call,
                      wide=wide, half=half, calls=[list(n) for n in narrowed])
    ref_device = ctx.device if ctx.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    x, out = ctx.standard()
    ctx.step("float64 forward")
    try:
        ref = float64_reference(ctx, x, ref_device)
    except Exception as e:  # noqa: BLE001 - code written for float32 (`probs.float() @ v` meeting float64): not measured
        if is_out_of_memory(e):
            raise
        return skipped("dtype.no_float64", error=one_line(e))
    name = dtype_name(ctx.dtype)
    if not torch.isfinite(out).all():
        return failed("dtype.nonfinite", None, dtype=name, reference_finite=bool(torch.isfinite(ref).all()))
    err = ((f64(out) - f64(ref)).norm() / f64(ref).norm().clamp_min(1e-30)).item()
    limit = DTYPE_TOLERANCE[ctx.dtype]
    if err > limit:
        return failed("dtype.differs", err, dtype=name, error=err, limit=limit)
    return passed("dtype.agrees", err, dtype=name, limit=limit)
