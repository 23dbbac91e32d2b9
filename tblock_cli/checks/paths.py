"""Paths a gradient takes, or does not: parameters no gradient reaches on a path the data chooses (an expert no token
of the probe was routed to), and parameters whose gradient is exactly zero while the output moves with them (a
rounding with no straight-through estimator). Read by `grad_params` (checks/gradients.py)."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context, eval_forward
from tblock_cli.checks.graphs import graph_nodes
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


# A parameter with an exactly zero gradient whose eval output moves by more than this (relative to max(1, |y|)) when
# it takes random values at half its scale about itself: its path is flat almost everywhere (a rounding), not
# invariant (a key bias moves the output by float rounding only, ~1e-7).
PIECEWISE_MOVE = 1e-3


def piecewise(ctx: Context, zero: list[str], mostly: dict) -> dict[str, float]:
    """Of the parameters with an exactly zero gradient, everywhere (and values not all zero: a zero start is
    optimizer_step's to judge) or at half their elements or more (`mostly`: where), those whose eval output moves
    when those elements alone take random values at half the parameter's scale about themselves: {name: move}. A
    masked or unrouted element moves nothing; one whose path rounds (weights fake-quantised by `torch.round`, their
    row's scale the one element with a gradient) does."""
    from tblock_cli.probes import parameters_replaced

    params = dict(ctx.subject.module.named_parameters())
    x, y = ctx.standard()
    out = {}
    for n in [*zero, *mostly]:
        p = params.get(n)
        if p is None or not p.detach().any():
            continue
        where = mostly.get(n)
        scale = f64(p.detach()).pow(2).mean().sqrt().item()
        step = torch.randn(p.shape, generator=ctx.gen, dtype=torch.float64)
        step = step if where is None else step * where.cpu()
        step = (step * (0.5 * scale / step.pow(2).mean().sqrt().clamp_min(1e-300))).to(p)  # RMS half the scale
        for sign in (1, -1):  # both ways: a coarse rounding (a scalar gate's) may keep one side in its step
            with parameters_replaced(params, [n], lambda _n, t, step=sign * step: t + step):
                move = rel_diff(eval_forward(ctx, x), y)
            if move > PIECEWISE_MOVE:
                out[n] = move
                break
    return out


# Other inputs, each of OTHER_BATCH times the probe's batch, a training forward of which may reach a parameter the
# probe's tokens did not: an expert of a sparse MoE that skips the experts no token chose (64 experts, top-1: with
# 4 x 16 x 10 tokens each expert is left out with probability (63/64)^640 ~ 4e-5 under even routing)
OTHER_INPUTS, OTHER_BATCH = 4, 8


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
        x = ctx.x(batch=OTHER_BATCH * ctx.cfg.batch)
        with seeded(ctx.device, i + 1), train_mode(ctx.subject.module, True), torch.enable_grad():
            try:
                out = first_tensor(ctx.subject(x))
            except Exception:  # noqa: BLE001 - a block of one batch size: no other input to try
                return missing
        reached = reached_parameters(out)
        left = {n for n in left if id(params[n]) not in reached}
        if not left:
            return []
    return [n for n in missing if n in left or n not in params]
