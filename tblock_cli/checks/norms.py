"""Checks of each norm alone: at large magnitude against float64, and its output scale at init."""

from __future__ import annotations

import math
import re

import torch

from tblock_cli.anatomy.norms import CLAIM_SCALES, NORM_CLASS, named_but_not_norms
from tblock_cli.checks.context import Context, nonfinite_kind
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import cast, f64, module_copy
from tblock_cli.runtime import dtype_name

# Input RMS for the large-magnitude probe: above 256, where an fp16 square overflows (256^2 > 65504), and far from
# fp16's own limit (a norm's input may reach 65504 / 16 before anything else overflows).
LARGE_RMS = 1e3
# Relative RMS error of a norm alone at LARGE_RMS against its float64 copy. Measured at d_model 64/512 on LayerNorm
# (built-in), Llama's upcasting RMSNorm and Gemma's (1 + w): <= 6.4e-8 float32, <= 3.0e-4 fp16, <= 2.4e-3 bf16; an
# fp16 RMSNorm squaring before it upcasts: 1.0 (it returns 0). 0.1 in half precision sits 40x above the worst.
NORM_ERROR = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 0.1, torch.bfloat16: 0.1}
# A stream whose mean dwarfs its spread (massive activations: a token's channels offset together ~1e3x the spread)
# leaves a norm's statistics to cancellation: the one-pass variance E[x^2] - E[x]^2 in float32 loses every digit of a
# spread 1e3x below the mean. A norm that subtracts the mean (its output the same, within SHIFT_INVARIANT, with its
# input shifted by 1 in every channel: LayerNorm's kind, not RMSNorm's) must give the same output shifted by SHIFT
# (float32 runs; relative RMS difference, the shifted input's own rounding included). At widths 32 to 4096: torch's
# LayerNorm <= 4.5e-5, two-pass and var_mean by hand <= 5.5e-5; the one-pass variance 4.3e-2 to 6.9e-2 (upcast to
# float32 or not: a float64 copy would compute it in float32 too). Shifted by 1: LayerNorms <= 1.3e-7, RMSNorm 0.7.
SHIFT = 1e3
SHIFT_INVARIANT = 1e-4
SHIFT_ERROR = 1e-3
# Output RMS at init of a (1 + w) norm (one whose output is not zero with its parameters zeroed), on unit-RMS
# input: 1.0 with w = 0 at init (Gemma); 2.0 with w initialised to 1, as a plain norm's weight is. 1.5 between.
OFFSET_GAIN_MAX = 1.5
# A norm's per-channel gain at init is a constant (ones, Gemma's 1 + 0, timm's ResPostBlock init_values 1e-5): positive
# in every channel. Its sign per channel is read as that of sum_t (N(x_t) - N(-x_t))_c x_tc (a norm is odd in its
# input: the difference is twice the gain times the normalised input). A share of negative channels above this is a
# gain drawn at random (an init loop `normal_(p, 0, 0.02)` over every parameter reached the norms: half the channels
# negative, the output ~50x too small: 42 % and 52 % measured on two LayerNorms of width 64).
RANDOM_GAIN_SHARE = 0.25
# A module whose class says LayerNorm or RMSNorm, at unit gain (weights all 1, or Gemma's 1 + 0, biases 0), returns
# tokens of RMS exactly 1 at LARGE_RMS (eps is 1e-11 of the variance there): measured 1 to 1e-7 in float32. Dividing by
# the unbiased variance (`x.var()`, n - 1) gives sqrt((n - 1) / n): 7.8e-3 off at width 64, 1e-4 at 5000. A norm of
# another class name is judged on that RMS alone (within the same tolerance of sqrt((n - 1) / n)): no correct norm
# returns it, while an L2 norm's 1 / sqrt(n) or a ScaleNorm's learned gain are designs.
UNIT_RMS_TOL = 1e-5
# A norm's per-channel parameters (gain, bias, Gemma's 1 + w) act on the token after it is normalised: with each of
# them redrawn, every output channel is an affine function, over tokens, of the same channel as built. A gain applied
# before normalising (x * w divided by the RMS of x * w) reaches the statistics, which mix channels. Residual of that
# fit (float64 copies), relative to the output's spread: correct norms ~1e-16 (a float32 step inside: ~1e-7); a gain
# before the statistics (gains redrawn by +-0.5) 0.05-0.07 at width 64, 0.015-0.023 at 512, falling as 1/sqrt(width).
AFFINE_TOL = 1e-4
# The same parameters enter linearly: with them redrawn twice (d1, d2), the output at their midpoint is the midpoint of
# the two outputs (x * w + b, x * (1 + w) alike). A gain applied twice (x * w * w) is per-channel affine for any one
# draw, but not linear in w: residual (w1 - w2) / 4 (w1 + w2) of the spread, 0.02-0.06 for draws within +-0.5 of 1.
# Correct norms: float64 rounding, ~1e-16 (a float32 step inside ~1e-7). Same limit as the affine fit.
# A norm computing in float16 adds its eps there: an eps below float16's smallest step (6e-8; BERT's 1e-12) is 0, and a
# LayerNorm's variance of a constant token (every channel equal, a zeroed padding embedding among them) is 0: 0 / 0. The
# probe's token is ones, not zeros: an RMS norm (F.normalize's eps is 1e-12 too) meets 0 / 0 only at the zero token, and
# that idiom (x-transformers' RMSNorm) is left alone.
HALF_CONSTANTS = (1.0,)
# The attribute names a block gives its norms (`attn_norm`, `ffn_norm`, `ln_1`, `norm1`, `input_layernorm`).
NORM_ATTRIBUTE = re.compile(r"norm|^ln(_?\d+|_\w+)?$|_ln(_?\d+)?$", re.I)
# A norm whose class name says it scales its input first (MuseSpark's InputScaledRMSNorm, by design) is not judged so.
SCALES_FIRST = re.compile(r"input_?scal|pre_?scal", re.I)


def rms(t: torch.Tensor) -> float:
    return f64(t).pow(2).mean().sqrt().item()


def check_norms(ctx: Context) -> Outcome:
    """Catches: a module whose class says LayerNorm or RMSNorm but whose output moves when its input is scaled (the
    square root forgotten: x / (mean x^2 + eps)) or whose output for one token moves with the other tokens (statistics
    over the sequence axis); each norm alone: relative RMS error against its float64 copy at input RMS 1e3 (an fp16 RMSNorm squaring
    before it upcasts returns 0: error 1.0; limit 0.1 half, 1e-4 float32) and, in float32, on tokens of spread 1 shifted by
    1e3, where it subtracts the mean (a one-pass variance E[x^2] - E[x]^2 cancels: 4e-2 to 7e-2 off; limit 1e-3); a `(1 + w)` norm whose output RMS at init
    exceeds 1.5 (w initialised to 1 doubles it); a norm whose gain has random signs at init (over a quarter of its
    channels negative: an init loop meant for the projections drew its weight from N(0, 0.02)); a module named
    LayerNorm or RMSNorm at unit gain whose tokens do not come out at RMS 1, and a norm of any class name whose tokens
    come out at sqrt((n - 1) / n) (the unbiased variance, `x.var()`); one named a norm (by its class, or by the
    block: `attn_norm`, `ln_1`) whose output, with its per-channel parameters redrawn, is not a per-channel scale and
    shift of its output as built is a **warning** (the gain applied before the statistics: the same at unit gain,
    another function once trained; not judged on a class named for it, `InputScaledRMSNorm`), and so is one whose output is not linear in those parameters
    (a gain applied twice, `x * w * w`: the midpoint of two draws against the midpoint of their outputs) and a norm
    whose float16 copy returns NaN or inf for a token of ones (a LayerNorm's variance 0 there: its eps, 1e-12 in
    BERT's LayerNorm written out, is 0 in float16)"""
    norms = ctx.dataflow().norms
    claimed = named_but_not_norms(ctx.subject.module, norms, ctx.cfg.d_model, ctx.device)
    if scaled := [m for m in claimed if m["scaled"]]:
        return failed("norms.not_invariant", round(scaled[0]["ratio"], 4), modules=scaled, scales=list(CLAIM_SCALES))
    if claimed:  # invariant to the input's scale, but one token's output moves with the others
        return failed("norms.across_tokens", round(claimed[0]["tokens"], 4), modules=claimed)
    if not norms:
        return skipped("norms.none")
    mods = dict(ctx.subject.module.named_modules())
    large, offset, random_gain, seen, errors, off_unit, not_affine, shifted = [], [], [], [], [], [], [], []
    not_linear, half_nan = [], []
    for name, width in norms.items():
        m = mods[name]
        x = torch.randn(2, 8, width, generator=ctx.gen, dtype=torch.float64)
        with torch.no_grad():
            try:
                big = x * LARGE_RMS
                got = m(big.to(device=ctx.device, dtype=ctx.dtype))
                ref = module_copy(m).to(dtype=torch.float64)(big.to(ctx.device))
                unit = m(x.to(device=ctx.device, dtype=ctx.dtype))
                zeroed = module_copy(m)
                for p in zeroed.parameters():
                    p.zero_()
                bare = zeroed(x.to(device=ctx.device, dtype=ctx.dtype))
                odd = f64(unit) - f64(m((-x).to(device=ctx.device, dtype=ctx.dtype)))
                shift = _shift_error(m, x, ctx) if ctx.dtype == torch.float32 else None
            except Exception:  # noqa: BLE001 - a norm that needs more than a tensor: find_norms called it, but be safe
                continue
        if not isinstance(got, torch.Tensor) or got.shape != big.shape:
            continue
        err = rel_rms(got, ref)
        seen.append(name)
        errors.append(err)
        if not err <= NORM_ERROR[ctx.dtype]:
            large.append({"name": name, "error": err, "got_rms": rms(got), "expected_rms": rms(ref)})
        if shift is not None and not shift <= SHIFT_ERROR:
            shifted.append({"name": name, "error": shift})
        if any(True for _ in m.parameters()) and rms(bare) > 0.5:
            gain = rms(unit)
            if gain > OFFSET_GAIN_MAX:
                offset.append({"name": name, "gain": gain})
        if ctx.dtype in (torch.float32, torch.float64) and _unit_gain(m):
            token_rms = f64(got).pow(2).mean(-1).sqrt()
            # named for a norm: RMS 1 is its claim; named otherwise: only the unbiased variance's own RMS is judged
            if (token_rms - 1).abs().max().item() > UNIT_RMS_TOL and (
                    NORM_CLASS.search(type(m).__name__)
                    or (token_rms - math.sqrt((width - 1) / width)).abs().max().item() <= UNIT_RMS_TOL):
                off_unit.append({"name": name, "rms": token_rms.mean().item(), "width": width})
        if _named_norm(name, m) and not SCALES_FIRST.search(type(m).__name__ + "." + name) \
                and (res := _affine_residual(m, x, width, ctx.own_gen())) is not None:
            if res[0] > AFFINE_TOL:
                not_affine.append({"name": name, "residual": res[0]})
            elif res[1] > AFFINE_TOL:
                not_linear.append({"name": name, "residual": res[1]})
        if ctx.dtype != torch.float16 and (got_half := _half_constant(m, width)) is not None:
            half_nan.append({"name": name, "got": got_half})
        signs = (odd * x.to(odd)).flatten(0, -2).sum(0)
        if any(True for _ in m.parameters()) and signs.numel() > 1 and (signs < 0).double().mean() > RANDOM_GAIN_SHARE:
            random_gain.append({"name": name, "negative": (signs < 0).double().mean().item(), "gain": rms(odd) / 2})
    facts = {"norms": seen, "dtype": dtype_name(ctx.dtype), "scale": LARGE_RMS}
    if large:
        worst = max(large, key=lambda n: n["error"])
        return failed("norms.large", round(worst["error"], 4), large=large, limit=NORM_ERROR[ctx.dtype], **facts)
    if shifted:
        worst = max(shifted, key=lambda n: n["error"])
        return failed("norms.shifted", round(worst["error"], 4), shifted=shifted, limit=SHIFT_ERROR, shift=SHIFT, **facts)
    if offset:
        return failed("norms.offset_init", round(max(o["gain"] for o in offset), 3), offset=offset, limit=OFFSET_GAIN_MAX,
                      **facts)
    if random_gain:
        return failed("norms.random_gain", round(max(r["negative"] for r in random_gain), 3), random_gain=random_gain,
                      limit=RANDOM_GAIN_SHARE, **facts)
    if off_unit:
        worst = max(off_unit, key=lambda n: abs(n["rms"] - 1))
        return failed("norms.not_unit", round(worst["rms"], 6), off_unit=off_unit, limit=UNIT_RMS_TOL, **facts)
    if not_affine:
        worst = max(not_affine, key=lambda n: n["residual"])
        # a warning: a mistake in most norms, one family's design (MuseSpark's input-scaled RMSNorm, named so)
        return warned("norms.gain_inside", round(worst["residual"], 4), not_affine=not_affine, limit=AFFINE_TOL, **facts)
    if not_linear:
        worst = max(not_linear, key=lambda n: n["residual"])
        # a warning: a gain kept positive by squaring it is a parametrisation someone may choose
        return warned("norms.gain_not_linear", round(worst["residual"], 4), not_linear=not_linear, limit=AFFINE_TOL,
                      **facts)
    if half_nan:
        # a warning: a norm that is never run in float16 (bfloat16 keeps float32's range) never meets it
        return warned("norms.half_eps", len(half_nan), half_nan=half_nan, constants=list(HALF_CONSTANTS), **facts)
    if not seen:
        return skipped("norms.none")
    return passed("norms.ok", len(seen), worst=max(errors), **facts)


def _shift_error(m, x: torch.Tensor, ctx: Context) -> float | None:
    """Relative RMS difference of m alone on x's tokens and on them shifted by SHIFT in every channel; None where m is
    not invariant to a shift (it does not subtract the mean: an RMSNorm) or returns something else than a tensor."""
    def run(shift: float):
        out = m((x + shift).to(device=ctx.device, dtype=torch.float32))
        return f64(out) if isinstance(out, torch.Tensor) else None

    base, near = run(0.0), run(1.0)
    if base is None or near is None or near.shape != base.shape or rel_rms(near, base) > SHIFT_INVARIANT:
        return None
    far = run(SHIFT)
    return rel_rms(far, base) if far is not None and far.shape == base.shape else None


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """|a - ref| / |ref| over all elements, in float64."""
    a, ref = f64(a), f64(ref)
    return (a - ref).norm().item() / max(ref.norm().item(), 1e-30)


def _unit_gain(m) -> bool:
    """A norm whose every parameter is all ones or all zeros (its gain 1, or 1 + 0)."""
    return all(bool((p == 1).all()) or not p.any() for p in m.parameters())


def _named_norm(name: str, m) -> bool:
    """A norm whose class says LayerNorm or RMSNorm, or that its block names a norm (`attn_norm`, `ln_1`, `norm1`):
    one that claims to scale and shift the normalised token."""
    return bool(NORM_CLASS.search(type(m).__name__) or NORM_ATTRIBUTE.search(name.rsplit(".", 1)[-1]))


def _affine_residual(m, x: torch.Tensor, width: int, gen: torch.Generator) -> tuple[float, float] | None:
    """How far, relative to the output's spread, a float64 copy of norm m with its per-channel parameters redrawn
    (each moved by up to 0.5) is from a per-channel affine function of the copy as built, over x's tokens; and how far
    the output with the parameters at the midpoint of two such draws is from the midpoint of their outputs (linear in
    the parameters). None where m has no per-channel parameter or cannot be called so."""
    try:
        built = cast(module_copy(m), torch.float64, torch.device("cpu"))
        drawn = [module_copy(built) for _ in range(3)]
        own = [[p for p in d.parameters() if p.ndim == 1 and p.shape[0] == width] for d in drawn]
        if not own[0]:
            return None
        with torch.no_grad():
            for p, q, mid in zip(*own):
                p.add_(torch.rand(p.shape, generator=gen, dtype=torch.float64) - 0.5)
                q.add_(torch.rand(q.shape, generator=gen, dtype=torch.float64) - 0.5)
                mid.copy_((p + q) / 2)
            u, y, z, w = (f(x).flatten(0, -2) for f in (built, *drawn))
    except Exception:  # noqa: BLE001 - a norm that needs more than a tensor: no evidence
        return None
    if not all(isinstance(t, torch.Tensor) and t.shape == u.shape for t in (y, z, w)):
        return None
    uc, yc = u - u.mean(0), y - y.mean(0)
    slope = (uc * yc).sum(0) / (uc * uc).sum(0).clamp_min(1e-300)
    affine = (yc - slope * uc).norm().item() / max(yc.norm().item(), 1e-300)
    linear = (w - (y + z) / 2).norm().item() / max((y - z).norm().item(), 1e-300)
    return affine, linear


def _half_constant(m, width: int) -> str | None:
    """What non-finite value a float16 copy of norm m (on the CPU) returns for constant tokens (HALF_CONSTANTS in every
    channel); None where they come out finite, or the copy cannot run in float16 (no evidence)."""
    try:
        half = cast(module_copy(m), torch.float16, torch.device("cpu"))
        tokens = torch.tensor(HALF_CONSTANTS, dtype=torch.float16)[None, :, None].expand(1, len(HALF_CONSTANTS), width)
        with torch.no_grad():
            out = half(tokens.clone())
    except Exception:  # noqa: BLE001 - a norm with no float16 kernel here, or one that needs more than a tensor
        return None
    if not isinstance(out, torch.Tensor) or bool(torch.isfinite(out).all()):
        return None
    return nonfinite_kind(out)
