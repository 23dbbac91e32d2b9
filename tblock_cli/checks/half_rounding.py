"""Half-precision findings held against a float64 copy of the block: where bfloat16 or float16 rounding flips a
discrete choice (a top-k over near-tied keys), two runs that should agree differ by far more than rounding, and a
float64 copy that agrees shows the difference is the run dtype's, not the block's."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import TOLERANCE, beyond, cast, f64, module_copy, rel_diff, train_mode, update_share


def prefix_exact_in_float64(ctx: Context, x: torch.Tensor, ts: list[int]) -> bool:
    """Whether a float64 copy of the block gives the first t + 1 tokens alone the outputs the whole sequence gives
    them, for every t of ts. A half-precision run rounds the scores of a sequence and of its prefix differently (their
    softmax rows have other lengths), which flips a top-k's choice among near-tied keys: 0.05 apart in bfloat16 on a
    top-4 attention that reads no length. A block that reads the length differs in float64 too. False where the copy
    is too large (above 50M parameters) or cannot run, and for a run in float32 or float64."""
    from tblock_cli.checks.training import too_large

    if ctx.dtype not in (torch.float16, torch.bfloat16) or too_large(ctx) is not None:
        return False
    try:
        copy = ctx.subject.like(cast(module_copy(ctx.subject.module), torch.float64, torch.device("cpu")))
        x64 = f64(x)
        with train_mode(copy.module, False), torch.no_grad():
            whole = copy(x64)
            return all(not beyond(rel_diff(alone := copy(x64[:, : t + 1]), whole[:, : t + 1]),
                                  update_share(alone, whole[:, : t + 1], x64[:, : t + 1]), TOLERANCE[torch.float64])
                       for t in ts)
    except Exception as e:  # noqa: BLE001 - a block that runs only in its own dtype: the half-precision finding stands
        if is_out_of_memory(e):
            raise
        return False
