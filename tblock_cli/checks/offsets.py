"""Attention scores as functions of position offsets: each row centred on its own diagonal entry (a row offset being
invisible to softmax), how far rows vary, the deviation from a function of i - j (Toeplitz), and the 2D reading of a
patch grid (a function of the row and column offsets, after a class token and registers)."""

from __future__ import annotations

import torch

from tblock_cli.anatomy.mha import MASKED_LOGIT

# The most special tokens before a patch grid that relative's 2D reading skips (a class token and four registers).
GRID_PREFIX = 5


def _scale(z: torch.Tensor, live: torch.Tensor) -> float:
    """max(1, |live score|): the deviations below are relative to it."""
    return max(1.0, z[torch.isfinite(z) & (z > MASKED_LOGIT)].abs().max().item()) if live.any() else 1.0


def centred_rows(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., T, T) scores with each row's own diagonal entry subtracted, and where they are live (not masked)."""
    valid = torch.isfinite(z) & (z > MASKED_LOGIT)
    diag = z.diagonal(dim1=-2, dim2=-1)[..., :, None]
    live = valid & valid.diagonal(dim1=-2, dim2=-1)[..., :, None]
    return (z - diag).masked_fill(~live, 0.0), live


def row_spread(z: torch.Tensor) -> float:
    """How far the live scores of any row move from the row's own diagonal entry, relative to max(1, |live score|):
    0 where every row is flat (no positions in the scores), or nothing is live."""
    rows, live = centred_rows(z)
    return rows.abs().max().item() / max(1.0, z[live].abs().max().item()) if live.any() else 0.0


def toeplitz_error(z: torch.Tensor) -> float:
    """Largest deviation of each diagonal's live entries from their mean, relative to max(1, |live score|)."""
    c, live = centred_rows(z)
    T = z.shape[-1]
    worst = 0.0
    for o in range(-(T - 1), T):
        d, m = c.diagonal(o, -2, -1), live.diagonal(o, -2, -1)
        if not m.any():
            continue
        n = m.sum(-1, keepdim=True).clamp_min(1)
        mean = d.sum(-1, keepdim=True) / n
        worst = max(worst, ((d - mean).abs() * m).max().item())
    return worst / _scale(z, live)


def grid_fit(z: torch.Tensor, limit: float) -> dict | None:
    """The first (prefix, width) under which the scores after `prefix` special tokens are a function of the 2D offset
    (row, column) of a patch grid `width` wide laid out row by row: 2D relative schemes (BEiT's bias table, EVA-02's
    rotary) after a class token and registers. None where no grid of two rows and two columns or more fits."""
    c, live = centred_rows(z)
    scale = _scale(z, live)
    for prefix in range(GRID_PREFIX + 1):
        n = z.shape[-1] - prefix
        i = torch.arange(n, device=z.device)
        cc = c[..., prefix:, prefix:].reshape(-1, n * n).double()
        m = live[..., prefix:, prefix:].reshape(-1, n * n).double()
        for width in (w for w in range(2, n // 2 + 1) if n % w == 0):
            key = ((i[:, None] // width - i[None, :] // width + n) * (2 * width + 1)
                   + (i[:, None] % width - i[None, :] % width + width)).flatten()
            sums = torch.zeros(cc.shape[0], int(key.max()) + 1, dtype=cc.dtype, device=z.device)
            mean = sums.index_add(1, key, cc * m) / sums.index_add(1, key, m).clamp_min(1)
            if ((cc - mean[:, key]).abs() * m).max().item() / scale <= limit:
                return {"prefix": prefix, "width": width}
    return None
