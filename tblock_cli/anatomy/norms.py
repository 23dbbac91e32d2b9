"""What a norm is, by what it does: a module whose output is unchanged when each token is scaled."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

# A norm leaves each token's output unchanged when the token is scaled (LayerNorm, RMSNorm): checked
# at this relative tolerance in float64 (eps moves a unit-scale token by ~eps, far below it).
NORM_INVARIANCE_TOL = 1e-4


def find_norms(module: nn.Module, d_model: int, device, dtype) -> dict[str, int]:
    """Modules that normalise over the last axis, found by what they do, not their class name: name -> width.

    A candidate owns only 1-D parameters of one size (or none, with 'norm' in its class name: width
    d_model); it is a norm when scaling each token of a random input by its own factor leaves its
    output unchanged. Width d_model: a norm of the residual stream; smaller: a per-head (QK) norm.
    """
    found: dict[str, int] = {}
    gen = torch.Generator().manual_seed(0)
    # half precision rounds each token's output: an RMSNorm computed in the run dtype measured up to 1.5e-3 (fp16)
    # and 1.2e-2 (bf16) on scaled copies of one token
    tol = NORM_INVARIANCE_TOL * {torch.float16: 100, torch.bfloat16: 400}.get(dtype, 1)
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.MultiheadAttention)):
            continue
        width = gains_width(m)
        if width is None or (width == 0 and "norm" not in type(m).__name__.lower()):
            continue
        if width in (0, 1):  # none, or one scalar gain (ScaleNorm: g * sqrt(d) x / |x|): d_model, not its own size
            width = d_model
        x = torch.randn(2, 3, width, generator=gen, dtype=torch.float64)
        s = torch.rand(2, 3, 1, generator=gen, dtype=torch.float64) * 4 + 0.5
        try:
            with torch.no_grad():
                a = m(x.to(device=device, dtype=dtype))
                b = m((x * s).to(device=device, dtype=dtype))
        except Exception:  # noqa: BLE001 - not callable on a (B, T, width) tensor: not a token norm
            continue
        if not isinstance(a, torch.Tensor) or a.shape != x.shape:
            continue
        a64, b64 = a.double().cpu(), b.double().cpu()
        if not torch.isfinite(a64).all() or a64.abs().max() == 0:
            continue
        # relative to the output's own size: a LayerScale at its init (x * 1e-5) moves by 1e-5 x (s - 1), far below an
        # absolute floor, yet by (s - 1) ~ 1 relative to what it returns
        if (a64 - b64).abs().max().item() <= tol * a64.abs().max().item():
            found[name] = width
    return {n: w for n, w in found.items() if not any(n != o and n.startswith(o + ".") for o in found)}  # outermost only


def gains_width(m: nn.Module) -> int | None:
    """The size of m's parameters where it owns at most two, all 1-D and of one size (a norm's gain and bias); 0 where
    it owns none; None otherwise (a projection, or more than a norm holds)."""
    own = list(m.parameters())
    if len(own) > 2 or any(p.ndim != 1 for p in own) or len({p.shape[0] for p in own}) > 1:
        return None
    return own[0].shape[0] if own else 0


def with_eps(module: nn.Module, norms: dict[str, int]) -> list[tuple[str, nn.Module]]:
    """The norms found that floor their variance with an `eps` attribute (LayerNorm, RMSNorm and look-alikes)."""
    mods = dict(module.named_modules())
    return [(n, mods[n]) for n in norms if isinstance(getattr(mods[n], "eps", None), (int, float))]


# Class names that say LayerNorm or RMSNorm (T5LayerNorm, LlamaRMSNorm, LayerNorm2d, rms_norm): a claim of the one
# property both have, that scaling the input leaves the output as it is.
NORM_CLASS = re.compile(r"(layer|rms)_?norm", re.I)
# The claim is judged between the input scaled by these two factors: large, so that any eps up to ~1 is negligible
# against the variance (1e4 and 1e6) and a norm of any axis grouping (LayerNorm2d over channels) is invariant too.
CLAIM_SCALES = (100.0, 1000.0)
# Relative change allowed between the two: correct norms differ by rounding (float64: 1e-15; a float32 upcast: 1e-7);
# a "norm" without its square root (x / (mean x^2 + eps)) scales its output 10x.
CLAIM_TOL = 1e-3


def named_but_not_norms(module: nn.Module, found: dict[str, int], d_model: int, device) -> list[dict]:
    """Modules whose class name says LayerNorm or RMSNorm, with at most two 1-D parameters of one size, that break a
    property both have (in a float64 copy): whose output moves when the whole input is scaled (CLAIM_SCALES: the square
    root forgotten, the variance multiplied in), or whose output for one token moves when the other tokens change
    while it is invariant to scaling each channel apart (each channel normalised over the sequence axis: `mean(1)` for
    `mean(-1)`). Modules that need more than one tensor, or change its shape, say nothing. [{name, cls, ratio, scaled,
    tokens}]: ratio = rms(out at the larger scale) / rms(out at the smaller), scaled = whether the output moved with
    the scale, tokens = the relative change of token 0's output."""
    from tblock_cli.probes import module_copy

    out = []
    gen = torch.Generator().manual_seed(0)
    for name, m in module.named_modules():
        if name in found or not NORM_CLASS.search(type(m).__name__):
            continue
        width = gains_width(m)
        if width is None:
            continue
        width = width or d_model
        x = torch.randn(2, 3, width, generator=gen, dtype=torch.float64)
        try:
            copy = module_copy(m).to(dtype=torch.float64)
            others = x.clone()
            others[:, 1:] = torch.randn(others[:, 1:].shape, generator=gen, dtype=torch.float64) * 3
            channels = x * torch.randn(width, generator=gen, dtype=torch.float64).exp()  # each channel its own scale
            with torch.no_grad():
                a, b, c, d = (copy((t * CLAIM_SCALES[0]).to(device))
                              for t in (x, x * CLAIM_SCALES[1] / CLAIM_SCALES[0], others, channels))
        except Exception:  # noqa: BLE001 - a conditional norm (AdaLN) or one that needs its own dtype: no claim judged
            continue
        if any(not isinstance(t, torch.Tensor) or t.shape != x.shape or not torch.isfinite(t).all() for t in (a, b, c, d)):
            continue
        a, b, c, d = (t.double().cpu() for t in (a, b, c, d))
        scale = max(a.abs().max().item(), b.abs().max().item())
        tokens = ((c[:, 0] - a[:, 0]).norm() / a[:, 0].norm().clamp_min(1e-300)).item()
        # one token's output moving with the others is the wrong axis only where each channel is normalised over the
        # tokens (invariant to scaling channels apart); statistics over tokens and channels together are a design
        per_channel = (d - a).abs().max().item() <= CLAIM_TOL * scale
        scaled = scale > 0 and (a - b).abs().max().item() > CLAIM_TOL * scale
        if scaled or (scale > 0 and tokens > CLAIM_TOL and per_channel):
            ratio = (b.pow(2).mean().sqrt() / a.pow(2).mean().sqrt().clamp_min(1e-300)).item()
            out.append({"name": name, "cls": type(m).__name__, "ratio": ratio, "scaled": scaled, "tokens": tokens})
    return out
