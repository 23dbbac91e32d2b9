"""The activation-checkpointing check: recomputing the block in the backward changes nothing, with its own switch too,
and every parameter still gets a gradient when the input requires none."""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.checks.context import Context, all_finite
from tblock_cli.checks.result import Outcome, failed, passed, warned
from tblock_cli.checks.training import all_modules, forked, has_dropout, seeded, too_large, trainable
from tblock_cli.probes import f64, rel_diff, train_mode

# Attribute or forward keyword names blocks use for their own activation-checkpointing switch.
SWITCHES = ("gradient_checkpointing", "use_checkpoint", "checkpoint", "grad_checkpointing", "use_gradient_checkpointing",
            "activation_checkpointing", "checkpointing", "use_checkpointing")


class RecomputeMismatch(RuntimeError):
    """The recompute saved another number of tensors than the forward (torch's own CheckpointError)."""


def power_iterations(module: nn.Module) -> tuple[nn.Module, ...]:
    """The modules whose training flag turns torch's spectral norm's power iteration on: its parametrization
    (`torch.nn.utils.parametrizations.spectral_norm`), or the layer a `torch.nn.utils.spectral_norm` hook sits on."""
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    return tuple(m for m in module.modules() if isinstance(m, _SpectralNorm)
                 or any(isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()))


def recomputed(fn, x: torch.Tensor, device: torch.device, host_streams: bool = False,
               quiet: tuple[nn.Module, ...] = ()) -> torch.Tensor:
    """fn(x) under activation checkpointing as torch.utils.checkpoint(use_reentrant=False) does it: the forward keeps
    none of the tensors autograd saves, the backward runs fn again under the forward's RNG state and uses what that run
    saves, in the same order. Only torch's streams are put back for the recompute, as torch's own function does: a
    mask drawn from Python's or NumPy's stream is drawn anew there (put back too with host_streams). The `quiet`
    modules run the recompute in eval mode (torch's spectral norm: no second power iteration). (torch's own
    function imports torch._dynamo on its first call: 1 s on an idle machine, several under load, for a probe of a few
    milliseconds.)"""
    state = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    count, again = [0], []

    def pack(_t: torch.Tensor) -> int:
        count[0] += 1
        return count[0] - 1

    def recompute() -> None:
        with (seeded(device) if host_streams else forked(device)), torch.enable_grad():
            torch.set_rng_state(state)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)
            was = [m.training for m in quiet]
            for m in quiet:
                m.training = False
            try:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: again.append(t) or len(again) - 1,
                                                              lambda j: again[j]):
                    fn(x.detach().requires_grad_(x.requires_grad))
            finally:
                for m, training in zip(quiet, was):
                    m.training = training
        if len(again) != count[0]:
            raise RecomputeMismatch(f"the recompute saved {len(again)} tensors where the forward saved {count[0]}: "
                                    f"the block's forward is not the same function twice")

    def unpack(i: int) -> torch.Tensor:
        if not again:
            recompute()
        return again[i]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


def _grads(ctx: Context, call, x: torch.Tensor, w: torch.Tensor | None, x_grad: bool = True):
    """Output, input gradient and every parameter's gradient of one seeded train forward + backward of call(x), and the
    buffers that step left (state_after); the buffers are put back after, so every step starts from the same state."""
    module = ctx.subject.module
    saved = {n: p.grad for n, p in module.named_parameters()}
    kept = [(m, k, b, b.detach().clone()) for m in module.modules() for k, b in m._buffers.items() if b is not None]
    for p in module.parameters():
        p.grad = None
    try:
        with seeded(ctx.device), train_mode(module, True), torch.enable_grad():
            xr = x.clone().requires_grad_(x_grad)
            out = call(xr)
            if out.requires_grad:  # else no parameter is reached at all (reentrant checkpointing of it all)
                (out.float() * w).sum().backward()
        grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in trainable(module)}
        return out.detach(), xr.grad, grads, state_after(module)
    finally:
        for n, p in module.named_parameters():
            p.grad = saved[n]
        with torch.no_grad():
            for m, k, b, values in kept:
                m._buffers[k] = b  # the object it was (a step may have put another in its place), with its values
                if b.shape == values.shape:
                    b.copy_(values)


def state_after(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a training step left, but torch's own norms' running statistics: recomputing a BatchNorm in the
    backward updates them again, as torch documents; that is torch's, not the block's."""
    norms = {id(m) for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)}
    return {f"{n}.{k}" if n else k: b.detach().clone() for n, m in module.named_modules() if id(m) not in norms
            for k, b in m._buffers.items() if b is not None}


def _state_differs(ref: dict, got: dict, tol: float) -> list[str]:
    """Buffers a checkpointed step leaves otherwise than the plain step (a count run again in the recompute)."""
    return sorted(n for n, b in ref.items() if n in got and not _same(got[n], b, tol))


def _same(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal buffers: exactly for integers, within tol of max(1, max |b|) for floats, NaN where both hold NaN (a cache
    allocated full of NaN and written in part)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not b.is_floating_point():
        return torch.equal(a, b)
    a, b = f64(a), f64(b)
    finite = b[torch.isfinite(b)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return torch.allclose(a, b, rtol=0.0, atol=tol * scale, equal_nan=True)


def _differs(ref, got) -> tuple[float, str | None]:
    """The largest relative difference between two (output, input grad, param grads, buffers) and where it is."""
    out0, gx0, gp0, _ = ref
    out1, gx1, gp1, _ = got
    worst = (rel_diff(out1, out0), "output")
    if gx0 is not None and gx1 is not None:
        worst = max(worst, (rel_diff(gx1, gx0), "input gradient"))
    for n, g in gp0.items():
        h = gp1.get(n)
        if g is None or h is None:
            d = 0.0 if g is None and h is None else math.inf
        else:
            d = rel_diff(h, g)
        worst = max(worst, (d, n))
    return worst


@contextmanager
def _switched_on(module: nn.Module):
    """The block's own checkpointing switch turned on (Hugging Face's, or a boolean attribute), restored after; yields
    how it was turned on, or None where the block has no such switch."""
    modules = all_modules(module)
    hf = next((m for m in modules if getattr(m, "supports_gradient_checkpointing", False)
               and callable(getattr(m, "activation_checkpointing_enable", getattr(m, "gradient_checkpointing_enable", None)))), None)
    if hf is not None:
        enable = getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable
        disable = getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable
        was_on = bool(getattr(hf, "is_gradient_checkpointing", False))  # then the plain run had it on: left as it is
        if not was_on:
            enable()
        try:
            yield f"{type(hf).__name__}.{enable.__name__}()"
        finally:
            if not was_on:
                disable()
        return
    flags = [(m, k) for m in modules for k in SWITCHES if isinstance(getattr(m, k, None), bool)]
    was = [(m, k, getattr(m, k)) for m, k in flags]
    # A Hugging Face layer reached without its model (a vision encoder's) calls the function its model would set
    funcs = [m for m, k in flags if k == "gradient_checkpointing" and not hasattr(m, "_gradient_checkpointing_func")]
    for m, k in flags:
        setattr(m, k, True)
    if funcs:
        from torch.utils.checkpoint import checkpoint  # the block's own switch calls it: its cost is the block's

        for m in funcs:
            m._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    try:
        yield f"{flags[0][1]} = True" if flags else None
    finally:
        for m, k, v in was:
            setattr(m, k, v)
        for m in funcs:
            del m._gradient_checkpointing_func


def check_checkpointing(ctx: Context) -> Outcome:
    """Catches: non-reentrant activation checkpointing (as `torch.utils.checkpoint(use_reentrant=False)` does it)
    around the block, and the block's own switch (Hugging Face's, a
    `use_checkpoint`/`checkpoint`/`grad_checkpointing` flag or keyword), that change outputs, input or parameter
    gradients with dropout active and the same seed, on a padded batch too (a padding mask its own path drops); parameters that get no gradient when the input does not require
    one (reentrant checkpointing inside); buffers a checkpointed step leaves otherwise than a plain one (a count or
    statistic the recompute updates again; torch's own norms' running statistics excepted); a **warning** where the
    recompute differs only because it draws from Python's or NumPy's random stream (a mask or a layer skip), which
    torch's checkpoint does not put back. Torch's spectral norm iterating again in the recompute (gradients off by
    about its power iteration's step) is torch's and passes, saying so"""
    if (large := too_large(ctx)) is not None:
        return large
    subject, module = ctx.subject, ctx.subject.module
    x = ctx.x()
    with torch.no_grad(), seeded(ctx.device), train_mode(module, True), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a checkpoint inside warns that nothing requires grad here: true, and meant
        shape = subject(x.clone()).shape
    w = torch.randn(shape, generator=ctx.gen).to(ctx.device)
    ctx.step("plain and checkpointed backward")
    plain = _grads(ctx, lambda t: subject(t), x, w)
    probes, state = {}, {}
    again, host, iterated = _recomputed_grads(ctx, x, w, plain)
    probes["non-reentrant checkpoint"] = _differs(plain, again)
    state["non-reentrant checkpoint"] = _state_differs(plain[3], again[3], ctx.tol)
    padded = _padded_plain(ctx, x, w) if _has_switch(module) else None
    with _switched_on(module) as how:
        if how is not None:
            ctx.step("the block's own checkpointing")
            own = _grads(ctx, lambda t: subject(t), x, w)
            probes[how], state[how] = _differs(plain, own), _state_differs(plain[3], own[3], ctx.tol)
            if padded is not None:  # its own path must pass every argument on: a padding mask it drops shows here
                mask, wm, ref = padded
                probes[how + " on a padded batch"] = _differs(ref, _grads(ctx, lambda t: subject(t, mask), x, wm))
    kwarg = _switch_keyword(module)
    if kwarg is not None:
        from tblock_cli.subject.loading import first_tensor

        probes[f"forward({kwarg}=True)"] = _differs(plain, _grads(ctx, lambda t: first_tensor(module(t, **{kwarg: True})), x, w))
    # An input that does not require grad (frozen embeddings before it, an adapter): every parameter still gets one.
    ctx.step("backward from an input without grad")
    with warnings.catch_warnings():  # torch's own warning about exactly this, printed mid-report otherwise
        warnings.simplefilter("ignore")
        frozen = _grads(ctx, lambda t: subject(t), x, w, x_grad=False)
    dropped = [n for n, g in plain[2].items() if g is not None and frozen[2].get(n) is None]
    facts = {"probes": {k: {"diff": d, "where": where} for k, (d, where) in probes.items()}, "limit": ctx.tol,
             "dropout": has_dropout(module), "power_iteration": iterated}
    if dropped:
        return failed("checkpointing.input_without_grad", f"{len(dropped)} params", params=dropped, **facts)
    name, (diff, where) = max(probes.items(), key=lambda kv: kv[1][0])
    if diff > ctx.tol:
        return failed("checkpointing.differs", diff, how=name, where=where, diff=diff, **facts)
    counted = next(((how, names) for how, names in state.items() if names), None)
    if counted is not None:  # outputs and gradients right, and state the recompute updated a second time
        return failed("checkpointing.state", f"{len(counted[1])} buffers", how=counted[0], buffers=counted[1], **facts)
    if host:  # the same once Python's and NumPy's streams are put back as well
        return warned("checkpointing.host_streams", None, what=host, **facts)
    return passed("checkpointing.same", diff, switches=[k for k in probes if k != "non-reentrant checkpoint"], **facts)


def _recomputed_grads(ctx: Context, x: torch.Tensor, w: torch.Tensor, plain) -> tuple:
    """The checkpointed step's (output, gradients, buffers); what differed (or the recompute's error) where it
    differs from the plain step only because torch's checkpoint does not put back Python's and NumPy's streams (a mask
    or layer skip drawn from them is drawn anew in the recompute); and what differed where it does only because
    torch's spectral norm runs its power iteration again in the recompute (its `_u`, `_v` moved once more: torch's,
    as BatchNorm's statistics updated twice are), the step then that of a recompute without it. None where it does
    not differ, or differs anyway."""
    subject = ctx.subject
    try:
        again = _grads(ctx, lambda t: recomputed(subject, t, ctx.device), x, w)
        diff, where = _differs(plain, again)
        if diff <= ctx.tol:
            return again, None, None
        what = f"the {where} differs by {diff:.1e}"
    except RecomputeMismatch as e:
        what, again = str(e), None
    try:
        kept = _grads(ctx, lambda t: recomputed(subject, t, ctx.device, host_streams=True), x, w)
    except RecomputeMismatch:
        kept = None
    if kept is not None and _differs(plain, kept)[0] <= ctx.tol:
        return kept, what, None
    quiet = power_iterations(subject.module)
    if quiet and again is not None:  # torch's spectral norm iterates again in the recompute: torch's, not the block's
        calm = _grads(ctx, lambda t: recomputed(subject, t, ctx.device, quiet=quiet), x, w)
        if _differs(plain, calm)[0] <= ctx.tol:
            return calm, None, what
    if again is None:  # a recompute that is not the forward's function whatever the streams: the error stands
        raise RecomputeMismatch(what)
    return again, None, None


def _has_switch(module: nn.Module) -> bool:
    with _switched_on(module) as how:
        return how is not None


def _padded_plain(ctx: Context, x: torch.Tensor, w: torch.Tensor):
    """(mask, the loss weights, the plain run's output and gradients) of x right-padded, loss on real positions: for a block that takes
    a padding mask, where that run is finite (nn.MultiheadAttention's NaN rows are padding's to report)."""
    from tblock_cli.checks.mixing import padding_mask

    if ctx.subject.pad_keyword is None:
        return None
    mask = padding_mask(ctx, x.shape[0], x.shape[1])
    w = w.masked_fill(mask[..., None], 0.0)
    ref = _grads(ctx, lambda t: ctx.subject(t, mask), x, w)
    finite = all_finite(ref[0]) and all(g is None or all_finite(g) for g in (ref[1], *ref[2].values()))
    return (mask, w, ref) if finite else None


def _switch_keyword(module: nn.Module) -> str | None:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in SWITCHES if k in params), None)


