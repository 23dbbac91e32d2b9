"""Paths a gradient takes, or does not: parameters no gradient reaches on a path the data chooses (an expert no token
of the probe was routed to), and parameters whose gradient is exactly zero while the output moves with them (a
rounding with no straight-through estimator). Read by `grad_params` (checks/gradients.py)."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context
from tblock_cli.checks.graphs import graph_nodes
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import f64, rel_diff, train_mode


def reached_parameters(out: torch.Tensor) -> set[int]:
    """ids of the leaves a backward from out would reach: the graph's AccumulateGrad nodes (no backward runs)."""
    return {id(node.variable) for node in graph_nodes(out.grad_fn) if hasattr(node, "variable")}


# A gradient with at most this share of non-zero elements is zero but for a few (a per-tensor quantiser's scale: its
# one largest element)
NEARLY_ZERO = 0.01


def scattered(zero: torch.Tensor) -> bool:
    """Whether a gradient's zeros (`zero`, where it is exactly 0) are a rounding's pattern: all but a few elements, or
    spread within its rows and within its columns (of the last axis), most rows and most columns that hold a zero
    holding a non-zero too (a per-row quantiser passes its row's largest element alone). Whole zero rows or columns are
    units nothing reached this step: an expert no token chose and its router row or column, a table's unused entries,
    a dead unit."""
    rows = zero.reshape(-1, zero.shape[-1])
    if 1 - rows.float().mean().item() <= NEARLY_ZERO:
        return True

    def mixed(m: torch.Tensor) -> bool:
        some = m.any(-1)
        return bool(some.any()) and 2 * int((some & ~m.all(-1)).sum()) >= int(some.sum())

    return mixed(rows) and mixed(rows.t())


# A parameter with an exactly zero gradient whose training output moves by more than this (relative to max(1, |y|))
# when it takes random values at half its scale about itself, at the draw that gave the gradient: its path is flat
# almost everywhere (a rounding), not invariant (a key bias moves the output by float rounding only, ~1e-7), nor
# dropped by that draw (stochastic depth, an expert dropout's draw left unrouted).
PIECEWISE_MOVE = 1e-3
PIECEWISE_SEED = 20


def piecewise(ctx: Context, zero: list[str], mostly: tuple[str, ...]) -> dict[str, float]:
    """Of the parameters with an exactly zero gradient in the training step, everywhere (values not all zero: a zero
    start is optimizer_step's to judge) or in a rounding's pattern (`mostly`, names), those whose gradient is so again in a
    seeded training step and whose training output at that same draw moves when those elements alone take random
    values at half the parameter's scale about themselves, either way: {name: move}. A masked or unrouted element, or
    a branch the draw dropped, moves nothing; one whose path rounds (weights fake-quantised by `torch.round`) does."""
    from tblock_cli.checks.training import seeded
    from tblock_cli.probes import grads_kept, parameters_replaced
    from tblock_cli.subject import first_tensor

    module = ctx.subject.module
    params = dict(module.named_parameters())
    names = [n for n in [*zero, *mostly] if n in params and params[n].detach().any()]
    if not names:
        return {}
    x = ctx.x()

    def forward(grad: bool = False) -> torch.Tensor:
        with seeded(ctx.device, PIECEWISE_SEED), train_mode(module, True), torch.set_grad_enabled(grad):
            return first_tensor(ctx.subject(x.clone()))

    where = {}
    with grads_kept(module):
        try:
            out = forward(grad=True)
            (out.float() * torch.randn(out.shape, generator=ctx.gen).to(out.device)).sum().backward()
        except Exception as e:  # noqa: BLE001 - a draw whose step raises: the training checks report it; no judgement
            if is_out_of_memory(e):
                raise
            return {}
        for n in names:
            g = params[n].grad
            if g is not None and g.layout == torch.strided and not g.any():
                where[n] = None
            elif g is not None and n in mostly and (z := g == 0).dim() >= 2 and 2 * int(z.sum()) >= z.numel() \
                    and scattered(z):
                where[n] = z
    base = forward()
    out = {}
    for n, mask in where.items():
        p = params[n]
        scale = f64(p.detach()).pow(2).mean().sqrt().item()
        step = torch.randn(p.shape, generator=ctx.gen, dtype=torch.float64)
        step = step if mask is None else step * mask.cpu()
        step = (step * (0.5 * scale / step.pow(2).mean().sqrt().clamp_min(1e-300))).to(p)  # RMS half the scale
        for sign in (1, -1):  # both ways: a coarse rounding (a scalar gate's) may keep one side in its step
            with parameters_replaced(params, [n], lambda _n, t, step=sign * step: t + step):
                move = rel_diff(forward(), base)
            if move > PIECEWISE_MOVE:
                out[n] = move
                break
    return out


# Other inputs, each of OTHER_BATCH times the probe's batch, a training forward of which may reach a parameter the
# probe's tokens did not: an expert of a sparse MoE that skips the experts no token chose (64 experts, top-1: with
# 4 x 16 x 10 tokens each expert is left out with probability (63/64)^640 ~ 4e-5 under even routing)
OTHER_INPUTS, OTHER_BATCH = 4, 8
OTHER_TOKENS = 4096  # at most this many tokens an input, however long the sequence (--seq 2048: batch 2)


def other_batch(ctx: Context) -> int:
    """The batch of the other inputs: OTHER_BATCH times the probe's, at most OTHER_TOKENS tokens (never below it)."""
    return max(ctx.cfg.batch, min(OTHER_BATCH * ctx.cfg.batch, OTHER_TOKENS // ctx.cfg.seq))


def unreached_by_other_inputs(ctx: Context, missing: list[str], in_graph: set[int]) -> list[str]:
    """The parameters without a gradient that no training forward of other, larger inputs reaches either (its graph
    read, no backward): those the block never uses. One reached is on a path the data chooses (an expert no token of
    the probe was routed to). One the step's graph reached (`in_graph`, ids) and left without a gradient is no path: a
    backward that drops it. All of them where such an input cannot run (a block of one batch size)."""
    from tblock_cli.checks.training import seeded
    from tblock_cli.subject import first_tensor

    params = dict(ctx.subject.module.named_parameters())
    left = {n for n in missing if n in params and id(params[n]) not in in_graph}
    if not left:
        return missing
    for i in range(OTHER_INPUTS):
        x = ctx.x(batch=other_batch(ctx))
        with seeded(ctx.device, i + 1), train_mode(ctx.subject.module, True), torch.enable_grad():
            try:
                out = first_tensor(ctx.subject(x))
            except Exception as e:  # noqa: BLE001 - a block of one batch size: no other input to try
                if is_out_of_memory(e):
                    raise
                return missing
        reached = reached_parameters(out)
        left = {n for n in left if id(params[n]) not in reached}
        if not left:
            return []
    return [n for n in missing if n in left or n not in params]
