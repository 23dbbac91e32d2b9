"""Paths a gradient takes, or does not: parameters no gradient reaches on a path the data chooses (an expert no token
of the probe was routed to), parameters whose gradient is exactly zero while the output moves with them (a
rounding with no straight-through estimator), and a matrix's rows or columns no gradient ever reaches (a
projection's output computed and discarded). Read by `grad_params` (checks/gradients.py)."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context
from tblock_cli.checks.graphs import graph_nodes
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import f64, grads_kept, parameters_replaced, rel_diff, train_mode


def reached_parameters(out: torch.Tensor) -> set[int]:
    """ids of the leaves a backward from out would reach: the graph's AccumulateGrad nodes (no backward runs)."""
    return {id(node.variable) for node in graph_nodes(out.grad_fn) if hasattr(node, "variable")}


# Matrix products and the operand slots of their autograd nodes: the left operand's rows and the right one's columns
# are the product's outputs (an nn.Linear's weight reaches addmm's right slot through a transpose: its rows)
PRODUCTS = {"MmBackward0": {0: "rows", 1: "columns"}, "AddmmBackward0": {1: "rows", 2: "columns"},
            "BmmBackward0": {0: "rows", 1: "columns"}, "BaddbmmBackward0": {1: "rows", 2: "columns"}}
# Nodes a weight may pass through on its way there: a cast (autocast's), a transpose (of a matrix: rows and columns
# swap)
CASTS = frozenset({"ToCopyBackward0"})
TRANSPOSES = frozenset({"TBackward0", "TransposeBackward0"})


def multiplied(out: torch.Tensor) -> dict[int, str]:
    """{id: "rows" or "columns"} for the leaves out's graph uses only as an operand of matrix products, reached
    through casts and (for a matrix) transposes alone, and always with the same axis as the product's output: a
    matrix the block multiplies by, whose output features are those rows or columns. Not a table it indexes or slices
    (a position table, T5's buckets, a pruning mask's product), nor one it multiplies along its output axis (one-hot
    positions times a table)."""
    found: dict[int, set] = {}
    for node in graph_nodes(out.grad_fn):
        if type(node).__name__ in CASTS | TRANSPOSES:
            continue  # walked through from the node that reads it
        slots = PRODUCTS.get(type(node).__name__, {})
        for i, (nxt, _) in enumerate(getattr(node, "next_functions", ())):
            axis, flips = slots.get(i), 0
            while nxt is not None and type(nxt).__name__ in CASTS | TRANSPOSES and len(nxt.next_functions) == 1:
                flips += type(nxt).__name__ in TRANSPOSES
                nxt = nxt.next_functions[0][0]
            if nxt is None or not hasattr(nxt, "variable"):
                continue
            if axis is not None and flips and nxt.variable.dim() != 2:
                axis = None  # a batch of matrices transposed: which axes is not read here
            elif axis is not None and flips % 2:
                axis = {"rows": "columns", "columns": "rows"}[axis]
            found.setdefault(id(nxt.variable), set()).add(axis)
    return {k: next(iter(v)) for k, v in found.items() if len(v) == 1 and None not in v}


def zero_slices(g: torch.Tensor, axis: str) -> torch.Tensor:
    """Which rows (or columns: the last axis) of a gradient are exactly zero throughout."""
    r = g.detach().reshape(-1, g.shape[-1])
    r = r if axis == "rows" else r.t()
    return (r.amax(-1) == 0) & (r.amin(-1) == 0)


def partly_dead(g: torch.Tensor, axis: str) -> bool:
    """Whether some whole rows (or columns) of a gradient are exactly zero and not all of them."""
    dead = zero_slices(g, axis)
    return bool(dead.any() and not dead.all())


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


def dead_slices(ctx: Context, names: dict[str, str]) -> dict[str, tuple[str, int, int]]:
    """Of the matrices ({name: output axis}) whose gradient had whole output rows or columns exactly zero, and not all,
    those whose same rows or columns get an exactly zero gradient again at the probe's seeded draw and in training
    steps of other inputs of about OTHER_TOKENS tokens, once with the block's parameters as they are and once with every
    parameter and floating buffer moved (at half its scale; a zero one given 1/sqrt(its last axis)): {name: (axis, how
    many, of how many)}. A unit a draw left off (a
    ReLU's, an expert's, its router's row), one behind a zero-initialised gate (adaLN-Zero's) or a pruning mask, comes
    alive in one of them; a projection's output that nothing reads (a chunk discarded, a slice of the keys' width
    kept) never does."""
    from tblock_cli.checks.training import seeded
    from tblock_cli.subject import first_tensor

    module = ctx.subject.module
    params = dict(module.named_parameters())
    names = {n: a for n, a in names.items() if n in params}
    if not names:
        return {}
    buffers = {f"buffer {n}": b for n, b in module.named_buffers() if b.is_floating_point()}

    def step(x: torch.Tensor, seed: int) -> dict[str, torch.Tensor | None]:
        for p in params.values():
            p.grad = None
        with seeded(ctx.device, seed), train_mode(module, True), torch.enable_grad():
            out = first_tensor(ctx.subject(x))
            (out.float() * torch.randn(out.shape, generator=ctx.gen).to(out.device)).sum().backward()
        zeros = {}
        for n, axis in names.items():
            g = params[n].grad
            g = torch.zeros(params[n].shape, device=params[n].device) if g is None else g
            zeros[n] = zero_slices(g, axis) if g.layout == torch.strided else None
        return zeros

    def moved(_n: str, t: torch.Tensor) -> torch.Tensor:
        scale = f64(t.detach()).pow(2).mean().sqrt().item() if t.numel() else 0.0
        scale = 0.5 * scale if 0 < scale < float("inf") else 1 / max(1, t.shape[-1] if t.dim() else 1) ** 0.5
        return t + scale * torch.randn(t.shape, generator=ctx.gen).to(t)

    everything = {**params, **buffers}
    batch = max(ctx.cfg.batch, OTHER_TOKENS // ctx.cfg.seq)  # every expert of 64 chosen at top-1: (63/64)^4096 ~ 1e-28
    with grads_kept(module):
        try:
            seen = [step(ctx.x(), PIECEWISE_SEED)]
            seen.append(step(ctx.x(batch=batch), PIECEWISE_SEED + 1))
            with parameters_replaced(everything, list(everything), moved):
                seen.append(step(ctx.x(batch=batch), PIECEWISE_SEED + 2))
        except Exception as e:  # noqa: BLE001 - a step that raises: the training checks report it; no judgement
            if is_out_of_memory(e):
                raise
            return {}
    out = {}
    for n, axis in names.items():
        if any(s[n] is None for s in seen):
            continue
        dead = torch.stack([s[n] for s in seen]).all(0)
        if dead.any() and not dead.all():
            out[n] = (axis, int(dead.sum()), dead.numel())
    return out
