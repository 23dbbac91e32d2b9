"""What a module's random training forwards look like, drawn many times: how many independent draws their spread
reflects, and whether they replace whole samples or rows by one learned value instead of masking."""

from __future__ import annotations

import torch


def distinct_draws(outs: torch.Tensor) -> float:
    """How many independent random draws the samples' spread reflects: the participation ratio tr(G)^2 / |G|^2 of
    the Gram matrix of the centred samples (elementwise masks: about the number of samples; one mask per batch
    element: about the batch)."""
    flat = outs.flatten(1).double()
    flat = flat - flat.mean(0)
    gram = flat @ flat.T
    norm = gram.pow(2).sum()
    return (gram.trace() ** 2 / norm).item() if norm > 0 else 0.0


def replaced_by_constant(outs: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether the draws replace whole samples or whole rows (last axis) by one and the same non-zero value, leaving
    the others as the eval forward gives them: a condition dropped by design (classifier-free guidance's null class, a
    caption swapped for a learned null sequence, a learned mask token), whose mean is meant to move. A dropout mask
    zeroes what it drops and rescales what it keeps."""
    if ref.ndim < 2 or not ref.is_floating_point():
        return False
    tol = 1e-6 * ref.abs().max().clamp_min(1e-30)
    for units, want in ((outs.reshape(len(outs), ref.shape[0], -1), ref.reshape(ref.shape[0], -1)),
                        (outs.reshape(len(outs), -1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1]))):
        changed = (units - want).abs().amax(-1) > tol  # (draws, units) each draw changed
        if not changed.any() or changed.all():
            continue
        new = units[changed]
        if new[0].abs().max() > tol and (new - new[0]).abs().max() <= tol:
            return True
    return False
