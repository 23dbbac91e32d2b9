"""The order check: self-attention without positions is permutation-equivariant, permuted tokens in giving the same
outputs permuted out."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context, eval_forward
from tblock_cli.checks.mixing import causal_by_itself, positional_reason
from tblock_cli.checks.result import Outcome, passed, skipped, warned
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import rel_diff

# Positions at each end of a sequence of identical tokens where a convolution over time sees its zero padding
EDGE = 4
# The ends differ by at least this much (relative) for a convolution's padding to be read there
EDGE_FLOOR = 1e-6


def convolved_edges(ctx: Context) -> float | None:
    """How far the outputs at the ends of a sequence of identical tokens differ from its middle's, where the middle's
    are all one (to the tolerance) and the ends' are not: a convolution over time inside the block (Conformer's,
    Primer's), whose zero padding the ends see; None otherwise. A scramble of heads (merged without their transpose)
    varies along the whole sequence, a roll or shift keeps identical tokens identical."""
    T = 4 * EDGE
    x = ctx.x(seq=1).expand(-1, T, -1).contiguous()
    try:
        out = eval_forward(ctx, x)
    except Exception as e:  # noqa: BLE001 - a block of one length: not read
        if is_out_of_memory(e):
            raise
        return None
    if out.ndim != 3 or out.shape[1] != T:
        return None
    middle = out[:, EDGE:T - EDGE]
    spread = rel_diff(middle, middle[:, :1].expand_as(middle))
    if spread > ctx.tol:
        return None
    # the middle's positions compute the same sums (bit-equal even in bfloat16); the ends differ by what the padding
    # leaves out, which a half-precision tolerance may exceed: well above the middle's spread is enough
    edges = rel_diff(out, out[:, EDGE:EDGE + 1].expand_as(out))
    return edges if edges > max(4 * spread, EDGE_FLOOR) else None


def check_order(ctx: Context) -> Outcome:
    """Self-attention without positions is permutation-equivariant: permuted tokens in, the same outputs permuted out.

    Catches: without `--causal`: permuted tokens in must give the same outputs permuted out; a failure is a
    **warning** (heads merged without transposing back, a roll or shift), not where identical tokens give outputs
    that vary with position (positions inside: a convolution over time, Conformer's)"""
    if ctx.cfg.causal:
        return skipped("order.causal")
    why = positional_reason(ctx)
    if why:
        return skipped("order.positional", **why)
    T = max(ctx.cfg.seq, 3)
    x = ctx.x(seq=T)
    if causal_by_itself(ctx, x):
        return skipped("order.causal_by_itself")
    perm = torch.randperm(T, generator=ctx.gen)
    if torch.equal(perm, torch.arange(T)):
        perm = perm.roll(1)
    perm = perm.to(ctx.device)
    diff = rel_diff(eval_forward(ctx, x[:, perm]), eval_forward(ctx, x)[:, perm])
    if diff > ctx.tol:
        from tblock_cli.checks.positions import positions_in_scores  # the identical-token probe relative shares
        if (where := positions_in_scores(ctx)) is not None:
            return skipped("order.positional", scores=where, diff=diff)
        if (edges := convolved_edges(ctx)) is not None:
            return skipped("order.positional", outputs=edges, diff=diff)
        return warned("order.scrambled", diff, diff=diff)
    return passed("order.equivariant", diff)
