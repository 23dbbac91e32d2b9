"""Half-precision findings held against the block computed in float64: where bfloat16 or float16 rounding flips a
discrete choice (a top-k over near-tied keys), two runs that should agree differ by far more than rounding, and a
float64 run that agrees shows the difference is the run dtype's, not the block's."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context
from tblock_cli.checks.forward import float64_reference
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import TOLERANCE, beyond, f64, rel_diff, update_share


def prefix_exact_in_float64(ctx: Context, x: torch.Tensor, ts: list[int]) -> bool:
    """Whether the block computed in float64 (forward.float64_reference, as `dtype` computes it) gives the first t + 1
    tokens alone the outputs the whole sequence gives them, for every t of ts. A half-precision run rounds the scores of
    a sequence and of its prefix differently (their softmax rows have other lengths), which flips a top-k's choice among
    near-tied keys: 0.05 apart in bfloat16 on a top-4 attention that reads no length. A block that reads the length
    differs in float64 too. False above 50M parameters, where float64 cannot run the block, and for a run in float32
    or float64."""
    from tblock_cli.checks.training import too_large

    if ctx.dtype not in (torch.float16, torch.bfloat16) or too_large(ctx) is not None:
        return False
    device = ctx.device if ctx.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    try:
        x64, whole = f64(x), f64(float64_reference(ctx, x, device))
        for t in ts:
            alone = f64(float64_reference(ctx, x[:, : t + 1], device))
            if beyond(rel_diff(alone, whole[:, : t + 1]), update_share(alone, whole[:, : t + 1], x64[:, : t + 1]),
                      TOLERANCE[torch.float64]):
                return False
        return True
    except Exception as e:  # noqa: BLE001 - a block that runs only in its own dtype: the half-precision finding stands
        if is_out_of_memory(e):
            raise
        return False
