"""The gradient-accumulation check: gradients that add up over two backwards without zeroing, a forward run between
a forward and its backward leaving that backward's gradients alone."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context
from tblock_cli.checks.graphs import carried_graphs, kept_graphs
from tblock_cli.checks.result import Outcome, failed, passed, skipped
from tblock_cli.checks.training import seeded, too_large, trainable
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import train_mode


def _backward_into(ctx: Context, x: torch.Tensor, weight: torch.Tensor, between=None) -> None:
    """One seeded train forward of x and the backward of a fixed projection, into whatever .grad holds; `between`,
    where given, is called after the forward and before its backward (another micro-batch's forward)."""
    module = ctx.subject.module
    with seeded(ctx.device), train_mode(module, True), torch.enable_grad():
        out = ctx.subject(x.clone().requires_grad_(True))
        later = between() if between is not None else None  # kept alive until the backward, as a graph in flight is
        (out.float() * weight).sum().backward()
        del later


def _grads(params) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in params}


def _off(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """How far a gradient is from what it should be, relative to the latter's largest entry (1.0 when it is gone)."""
    if got is None:
        return 1.0
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def check_grad_accumulation(ctx: Context) -> Outcome:
    """Catches: gradients that do not add up over two backwards without zeroing (micro-batches of gradient
    accumulation): the same seeded step twice must leave twice the gradient of one; a forward that frees or zeroes
    `.grad`, a backward that writes `.grad` instead of adding to it; a backward that reads what a later forward
    overwrote (two micro-batches in flight: an input stashed on the module); a tensor the block keeps whose autograd
    graph after the second step reaches the one it kept after the first (an auxiliary loss summed into an attribute
    across calls, a state carried without detach): every step's graph stays alive, and a loss that reads it
    backpropagates into steps already taken"""
    if (large := too_large(ctx)) is not None:
        return large
    params = trainable(ctx.subject.module)
    if not params:
        return skipped("grad_accumulation.no_params")
    saved = {n: p.grad for n, p in params}
    x = ctx.x()
    weight = ctx.randn(*x.shape).float()  # the projection of an output of the input's shape (the shape check's)
    limit = 10 * ctx.tol
    apart, mixed = {}, {}
    try:
        for _, p in params:
            p.grad = None
        _backward_into(ctx, x, weight)
        one = _grads(params)
        kept = kept_graphs(ctx.subject.module)
        _backward_into(ctx, x, weight)  # a second micro-batch, the same one: .grad must now hold twice the first
        two = _grads(params)
        if carried := carried_graphs(ctx.subject.module, kept):
            return failed("grad_accumulation.graph_carried", len(carried), tensors=carried)
        del kept
        off = {n: _off(two[n], 2 * g) for n, g in one.items() if g is not None and g.any()}
        wrong = {n: e for n, e in off.items() if e > limit}
        if wrong:  # a step that is not repeatable (its own generator, state it advances) is no evidence: a fresh one
            for _, p in params:
                p.grad = None
            _backward_into(ctx, x, weight)
            again = _grads(params)
            if any(_off(again[n], one[n]) > limit for n in wrong):
                return skipped("grad_accumulation.not_repeatable", params=sorted(wrong))
        if not wrong:
            ctx.step("two forwards, then the first's backward")
            first = _first_of_two(ctx, x, weight, params)
            apart = {n: _off(first[n], g) for n, g in one.items() if g is not None and g.any()} if first else {}
            mixed = {n: e for n, e in apart.items() if e > limit}
    finally:
        for n, p in params:
            p.grad = saved[n]
    worst = max(off.values(), default=0.0)
    facts = {"limit": limit, "checked": len(off), "wrong": sorted(wrong, key=wrong.get, reverse=True)}
    if wrong:
        return failed("grad_accumulation.lost", round(worst, 4), worst=worst, **facts)
    if mixed:
        worst = max(mixed.values())
        return failed("grad_accumulation.interleaved", round(worst, 4), worst=worst, limit=limit,
                      wrong=sorted(mixed, key=mixed.get, reverse=True))
    return passed("grad_accumulation.adds", worst, worst=worst, interleaved=max(apart.values(), default=0.0), **facts)


def _first_of_two(ctx: Context, x: torch.Tensor, weight: torch.Tensor, params) -> dict[str, torch.Tensor | None]:
    """The gradients of x's seeded step when another forward (x reversed along the sequence) runs before its
    backward, as pipeline schedules and micro-batches in flight do: a backward that reads what the later forward
    overwrote (an input stashed on the module, a buffer) gives other gradients than the step alone. None where that
    backward raises (a tensor it saved written in place by the later forward): not judged here."""
    for _, p in params:
        p.grad = None
    try:
        _backward_into(ctx, x, weight, between=lambda: ctx.subject(x.flip(1).requires_grad_(True)))
    except RuntimeError as e:
        if is_out_of_memory(e):
            raise
        return None
    return _grads(params)
