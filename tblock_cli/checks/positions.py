"""Checks of positions inside attention: a relative scheme's scores depend on i - j only (Toeplitz), and an additive
position bias (ALiBi) falls with distance at the paper's geometric slopes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.anatomy.attention import Captured
from tblock_cli.anatomy.mha import MASKED_LOGIT
from tblock_cli.anatomy.tracer import Tracer
from tblock_cli.checks.context import IDENTICAL_SCORES, Context
from tblock_cli.checks.offsets import centred_rows, grid_fit, row_spread, toeplitz_error
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import parameters_swapped, train_mode

# Largest deviation of identical-token scores from a Toeplitz matrix (each row shifted so its own diagonal entry is 0,
# a row offset being invisible to softmax), relative to max(1, |score|). Measured at d_model 64/512: correct relative
# blocks (RoPE, GQA, sliding window, ALiBi, RoPE on values, Gemma, 3-D mask) <= 3e-7 float32, <= 1.9e-3 fp16 and
# <= 0.014 bf16 at 320 tokens; a rotary layout mismatch 0.35-0.88 at any length; rotary angles computed in bf16
# 0.55-0.73 at 320 tokens (in fp16: 0.013-0.024, under the limit: fp16 keeps integer positions exact to 2048).
TOEPLITZ_LIMIT = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 0.05, torch.bfloat16: 0.05}
# Half precision is probed at this length too: bfloat16 holds integers exactly only up to 256 (fp16's products of
# position and frequency lose the fraction there too), so angles computed in the run dtype break past it.
LONG_SEQ = 320
# An additive bias is judged where the scores minus their q.k part vary by more than this along a row. Measured over
# 64 tokens at d_model 64/512: blocks with no bias (RoPE, window, 3-D float mask) <= 7e-12; ALiBi 16-32.
BIAS_MIN = 0.05
# A bias is ALiBi-like (linear in distance per head) when a straight line fits it within this share of its range; a
# learned relative bias (T5 buckets) is not judged. ALiBi measured <= 6e-8 float32, 5e-4 fp16, 1.6e-2 bf16.
LINEAR_FIT = 0.05
# Slopes whose successive ratios spread by more than this share are not geometric (the paper's: one ratio, 2^(-8/n)),
# and slopes off the paper's by more than it are not the paper's. Measured on ALiBi: spread and offset <= 2e-8
# float32, <= 1.9e-3 in half precision; planted linear slopes: spread 0.33-0.43.
GEOMETRIC_TOL = {torch.float64: 0.01, torch.float32: 0.01, torch.float16: 0.05, torch.bfloat16: 0.05}
# A slope this close to 0 is a head without a bias (ALiBi's smallest, for 64 heads, is 2^-8 ~ 4e-3).
SLOPE_FLOOR = 1e-4
# Scores probed for a bias over this many tokens: long enough for the smallest slope to rise above rounding.
BIAS_SEQ = 64
# relative's identical-token scores (8 or more tokens) minus a fitted multiple of their q.k part, varying along a row by
# less than this: no additive bias there, and position_bias needs no forward of its own. A bias linear in distance that
# BIAS_MIN sees over BIAS_SEQ tokens is at most 9x smaller over 8: this is 16x below. Rounding measured ~1e-6 (float32).
NO_BIAS = BIAS_MIN / 16


def captured_scores(ctx: Context, x: torch.Tensor, subject=None, train: bool = False) -> tuple[list, Tracer]:
    """One forward of x (eval unless train) with the tracer capturing each attention call's scores and q.k product;
    of `subject` where given (a check's copy), else the block's."""
    subject = subject or ctx.subject
    tr = Tracer(subject.module, ctx.cfg.d_model, capture=True)
    tr.prov.watch(x)  # what reads the input's tokens, as the dataflow follows it (a product of two tables is no score)
    with train_mode(subject.module, train), torch.enable_grad(), tr:
        subject(x.clone())
    return [(c, tr.attn.captured.get(i)) for i, c in enumerate(tr.attn.calls)], tr


@dataclass(frozen=True)
class Identical:
    """Each attention call with its scores captured on identical tokens, and which projections read uniform rows."""

    calls: list  # (AttentionCall, captured scores or None)
    uniform_in: dict


def identical(ctx: Context, T: int) -> Identical:
    """One traced eval forward of T identical tokens, capturing every attention call's scores."""
    x = ctx.randn(1, 1, ctx.cfg.d_model).expand(1, T, ctx.cfg.d_model).contiguous()
    calls, tr = captured_scores(ctx, x)
    return Identical(calls, tr.attn.uniform_in)


def identical_scores(ctx: Context) -> Identical:
    """The IDENTICAL_SCORES probe, at relative's first length: relative judges it, position_bias reads whether any
    call carries a bias at all (a raise is kept: position_bias then probes the bias its own way)."""
    return ctx.probe(IDENTICAL_SCORES, lambda: identical(ctx, identical_length(ctx)))


def identical_length(ctx: Context) -> int:
    return max(ctx.cfg.seq, 8)


def positions_in_scores(ctx: Context) -> str | None:
    """Where attention's scores on identical tokens vary along a row beyond the run dtype's rounding (TOEPLITZ_LIMIT,
    relative to max(1, |score|)) as relative positions make them: q and k projected from the identical rows, the
    scores a function of i - j (rotary tables computed in the forward), whatever the machinery is called. Tokens merged
    or shifted in the wrong order leave identical tokens' scores flat; heads split without their transpose make them
    vary with no i - j structure; a scramble before some attention's projections feeds it rows that are no longer
    identical (not excused: an absolute embedding added inside is not told from it). None where no call shows it, or
    the probe cannot run."""
    try:
        seen = identical_scores(ctx)
    except Exception as e:  # noqa: BLE001 - a block the tracer cannot follow: no evidence either way
        if is_out_of_memory(e):
            raise
        return None
    limit = TOEPLITZ_LIMIT.get(ctx.dtype, 1e-4)
    for c, got in seen.calls:
        if got is None or got.logits.shape[-1] != got.logits.shape[-2]:
            continue
        z = got.logits
        if row_spread(z) <= limit:
            continue
        sources = [n for n in c.q + c.k if n in seen.uniform_in]
        if sources and all(seen.uniform_in[n] for n in sources) and toeplitz_error(z) <= limit:
            return c.where or "root"
    return None


def relative_calls(ctx: Context, T: int) -> list[dict]:
    """Per square attention call whose q and k projections read identical rows: its Toeplitz error at length T."""
    return toeplitz_calls(identical_scores(ctx) if T == identical_length(ctx) else identical(ctx, T), T)


def relative_calls_fresh(ctx: Context, T: int) -> list[dict]:
    """relative_calls from a forward of its own (the block's parameters changed for a while), not the shared probe."""
    return toeplitz_calls(identical(ctx, T), T)


def toeplitz_calls(seen: Identical, T: int) -> list[dict]:
    out = []
    calls, uniform_in = seen.calls, seen.uniform_in
    for c, got in calls:
        if got is None or got.logits.shape[-1] != got.logits.shape[-2] or got.logits.shape[-1] != T:
            continue
        sources = [n for n in c.q + c.k if n in uniform_in]
        if not sources or not all(uniform_in[n] for n in sources):
            continue  # positions entered before the projections (absolute): scores need not be Toeplitz
        z = got.logits
        out.append({"where": c.where or "root", "seq": T, "error": toeplitz_error(z),
                    "tail": toeplitz_error(z[..., T // 2:, T // 2:]), "spread": row_spread(z), "logits": z})
    return out


def check_relative(ctx: Context) -> Outcome:
    """With every token identical, scores of a relative (or no) position scheme depend on i - j only (the registry
    runs it through alignment.check_relative, which says what it catches)"""
    if not ctx.dataflow().attention:
        return skipped("relative.no_attention")
    lengths = [identical_length(ctx)] + ([LONG_SEQ] if ctx.dtype in (torch.float16, torch.bfloat16) else [])
    calls, long_error = [], None
    for T in lengths:
        try:
            calls += relative_calls(ctx, T)
        except Exception as e:  # noqa: BLE001 - a block with a maximum length below LONG_SEQ: judged at its own length
            if T != LONG_SEQ:
                raise
            long_error = type(e).__name__
    if not calls:
        return skipped("relative.absolute")
    limit = TOEPLITZ_LIMIT[ctx.dtype]
    worst = max(calls, key=lambda c: c["error"])
    facts = {"where": worst["where"], "seq": worst["seq"], "error": worst["error"], "limit": limit, "long_error": long_error}
    # scores flat along every row carry no positions: gains acting after a rotation would have made them vary
    positioned = any(c["spread"] > limit for c in calls)
    facts["positioned"] = positioned
    if worst["error"] <= limit and positioned and (drawn := relative_with_gains_drawn(ctx)) is not None \
            and drawn["drawn_error"] > limit:
        # a warning: a q/k norm after the rotation is a bug in most blocks, and one family's design (HunYuan's)
        return warned("relative.gains_inside", drawn["drawn_error"], **facts, **drawn)
    if worst["error"] > limit:
        tail = max(c["tail"] for c in calls)
        if tail > limit:
            grids = [grid_fit(c["logits"], limit) if c["error"] > limit else {} for c in calls]
            if all(g is not None for g in grids):  # every call a function of the 2D offset on some grid
                return passed("relative.grid", worst["error"], **facts, grids=[g for g in grids if g])
            return failed("relative.not_toeplitz", worst["error"], **facts)
        # Toeplitz from the middle on, not at the start: something translation-equivariant whose zero padding reaches
        # the first positions (Primer's causal depthwise convolutions on q/k/v), not a position scheme
        return passed("relative.edge", tail, **facts, tail=tail, start=worst["seq"] // 2)
    return passed("relative.toeplitz", worst["error"], **facts)


def relative_with_gains_drawn(ctx: Context) -> dict | None:
    """relative's probe again with every constant per-channel parameter (a norm's gain or bias, a projection's bias:
    ones or zeros at init) redrawn by up to 0.5: a gain or bias that acts on q or k after the rotation (a q/k norm after
    the rotary embedding, a bias added to rotated queries) breaks i - j only once it is not constant. The worst call;
    None where the block keeps no such parameter, or is above the training-time checks' size (50M parameters)."""
    from tblock_cli.checks.training import too_large

    if too_large(ctx) is not None:  # a forward more over every weight: left to blocks of training-check size
        return None
    drawn, names, gen = {}, [], ctx.own_gen()  # its own stream: the checks after it draw as before
    for mname, m in ctx.subject.module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            # per channel (wider than the head count): a per-head factor or bias (a position-dependent softmax
            # temperature, SSMax and Mistral Large 3's) is a design that scales whole rows, not a channel's
            if p.ndim == 1 and p.numel() > max(1, ctx.cfg.n_heads) and p.is_floating_point() and bool((p == p[0]).all()):
                noise = torch.rand(p.shape, generator=gen, dtype=torch.float64) - 0.5
                if (m, pname) not in drawn:  # a module reached twice (shared) is drawn once
                    drawn[(m, pname)] = nn.Parameter(p.detach() + noise.to(p), requires_grad=p.requires_grad)
                    names.append(f"{mname}.{pname}" if mname else pname)
    if not drawn:
        return None
    try:
        with parameters_swapped(drawn):
            calls = relative_calls_fresh(ctx, identical_length(ctx))
    except Exception as e:  # noqa: BLE001 - a block that refuses other values of its parameters: no evidence
        if is_out_of_memory(e):
            raise
        return None
    if not calls:
        return None
    worst = max(calls, key=lambda c: c["error"])
    return {"drawn_where": worst["where"], "drawn_error": worst["error"], "drawn": sorted(names)}


def line_fit(f: torch.Tensor) -> tuple[float, float]:
    """Slope of f(d) = c - m d over d = 0..n-1 (least squares), and the fit's worst residual."""
    d = torch.arange(f.numel(), dtype=torch.float64, device=f.device)
    A = torch.stack((torch.ones_like(d), -d), dim=1)
    coef = torch.linalg.lstsq(A, f[:, None]).solution[:, 0]
    return coef[1].item(), (A @ coef - f).abs().max().item()


def paper_slopes(n: int) -> list[float]:
    """ALiBi's slopes for n heads: geometric from 2^(-8/n); for n not a power of two, the paper's interleaving."""
    p = 2 ** math.floor(math.log2(n))
    first = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    return first + paper_slopes(2 * p)[0::2][: n - p] if p < n else first


def product_like(got: Captured, z: torch.Tensor) -> torch.Tensor:
    """A captured call's q.k product in float64 on the CPU, laid out like the scores z (RuntimeError where it is laid
    out otherwise: bloom's (batch * heads, T, T))."""
    return got.product.detach().double().cpu().expand_as(z)


def sample_scores(got: Captured | None, i: int) -> Captured | None:
    """Sample i's captured scores of a two-sample forward (None where the scores do not lead with that batch of 2)."""
    if got is None or got.product is None or got.logits.shape[0] != 2:
        return None
    try:  # a product laid out otherwise (bloom's (batch * heads, T, T)) is read from one forward per input instead
        product = product_like(got, got.logits)
    except RuntimeError:
        return None
    return Captured(got.logits[i : i + 1], product[i : i + 1])


def score_pairs(ctx: Context, a: torch.Tensor, b: torch.Tensor) -> list[tuple]:
    """Per attention call, the scores captured for input a and for input b: from one forward of both side by side
    where samples are known apart and every call's scores lead with the batch, else from a forward each."""
    if ctx.batched(a, b):
        both, _ = captured_scores(ctx, torch.cat([a, b]))
        pairs = [(sample_scores(got, 0), sample_scores(got, 1)) for _, got in both]
        if all(p is not None and q is not None for p, q in pairs):
            return pairs
    first, _ = captured_scores(ctx, a)
    second, _ = captured_scores(ctx, b)
    return [(got, other) for (_, got), (_, other) in zip(first, second)]


def fitted_scale(z: torch.Tensor, p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The least-squares s of z = s * p over the valid entries."""
    z, p = z[valid], p[valid]
    return (z * p).sum() / (p * p).sum().clamp_min(1e-30)


def centred_bias(z: torch.Tensor, p: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(heads, T, T) scores minus their q.k part (scale * p), each row centred on its own entry (centred_rows)."""
    T = z.shape[-1]
    return centred_rows((z - scale * p).masked_fill(~valid, float("-inf")).reshape(-1, T, T))


def head_biases(ctx: Context) -> list[torch.Tensor]:
    """Per attention call with an additive bias: its (heads, T) bias by distance 0..T-1, from the row's own entry."""
    T = max(ctx.cfg.seq, BIAS_SEQ)
    out = []
    for got, other in score_pairs(ctx, ctx.x(1, T), ctx.x(1, T)):
        if got is None or other is None or got.product is None or other.product is None \
                or got.logits.shape[-1] != T or got.logits.shape[-2] != T or other.logits.shape != got.logits.shape:
            continue
        z, p = got.logits, product_like(got, got.logits)
        z2, p2 = other.logits, product_like(other, z)
        # an input-independent bias cancels between two inputs: the difference of the scores is the scale times
        # the difference of the products, exactly
        valid = torch.isfinite(z) & (z > MASKED_LOGIT) & torch.isfinite(z2) & (z2 > MASKED_LOGIT)
        c, live = centred_bias(z, p, valid, fitted_scale(z - z2, p - p2, valid))
        if (c.abs() * live).max().item() <= BIAS_MIN:
            continue
        # by distance d = i - j >= 0 (the keys before; a causal block has no others), averaged down each diagonal
        f = torch.stack([(c.diagonal(-d, -2, -1) * live.diagonal(-d, -2, -1)).sum(-1)
                         / live.diagonal(-d, -2, -1).sum(-1).clamp_min(1) for d in range(T)], dim=-1)
        out.append(f)
    return out


def unbiased(got: Captured | None) -> bool:
    """Whether one input's captured scores are a multiple of their q.k product along every row (to NO_BIAS): no additive
    bias. A call that is not square (cross-attention) is not judged, as head_biases judges none. False where the
    scores cannot be read."""
    if got is None or got.product is None:
        return False
    z = got.logits
    if z.ndim < 2 or z.shape[-1] != z.shape[-2]:
        return True
    try:
        p = product_like(got, z)
    except RuntimeError:
        return False
    valid = torch.isfinite(z) & (z > MASKED_LOGIT)
    if not valid.any():
        return False
    c, live = centred_bias(z, p, valid, fitted_scale(z, p, valid))
    return (c.abs() * live).max().item() <= NO_BIAS


def check_position_bias(ctx: Context) -> Outcome:
    """An additive bias linear in distance (ALiBi) must fall with distance, at geometric slopes (the paper's set).

    Catches: an additive bias linear in distance (ALiBi) that rises with distance or whose slopes are neither
    geometric nor the paper's set (which interleaves two geometric runs for a head count not a power of two); slopes
    of either kind but not the paper's in head order are a **warning** (the paper's over sqrt(d_head) pass: Falcon adds
    the paper's bias before scaling the scores, and its `alibi=True` checkpoints were trained so); a learned
    (non-linear) bias is not judged; where
    `relative`'s identical-token scores are a multiple of their q.k product (no bias), no probe of its own; a block
    that does not run at the probe's 64 tokens (a patch grid of one length, a shorter table) is not judged"""
    flow = ctx.dataflow()
    if not flow.attention:
        return skipped("position_bias.no_attention")
    try:  # relative's forward (whichever asks first pays): no bias in any call needs no forward of this check's own
        seen = [got for _, got in identical_scores(ctx).calls]
    except Exception as e:  # noqa: BLE001 - that forward raised: the bias is probed below, its own way
        if is_out_of_memory(e):
            raise
        seen = None
    if seen is not None and len(seen) == len(flow.attention) and all(unbiased(got) for got in seen):
        return skipped("position_bias.none")
    try:
        biases = head_biases(ctx)
    except Exception as e:  # noqa: BLE001 - a block of a fixed length (a patch grid) or a shorter table: not judged
        if is_out_of_memory(e) or seen is None:
            raise
        return skipped("position_bias.length", seq=max(ctx.cfg.seq, BIAS_SEQ), error=one_line(e))
    if not biases:
        return skipped("position_bias.none")
    for f in biases:
        fits = [line_fit(row) for row in f]
        span = (f.amax(-1) - f.amin(-1)).clamp_min(1e-30)
        if any(res > LINEAR_FIT * s for (_, res), s in zip(fits, span.tolist())):
            return passed("position_bias.learned", None, heads=f.shape[0])
        slopes = [m for m, _ in fits]
        facts = {"slopes": [round(m, 6) for m in slopes], "expected": [round(m, 6) for m in paper_slopes(len(slopes))]}
        if min(slopes) < -SLOPE_FLOOR:
            return failed("position_bias.rises", round(min(slopes), 6), **facts)
        if min(slopes) <= SLOPE_FLOOR:  # some heads carry no bias: not the ALiBi the slopes below describe
            return passed("position_bias.learned", None, heads=f.shape[0])
        ordered = sorted(slopes, reverse=True)
        ratios = [b / a for a, b in zip(ordered, ordered[1:])]
        tol = GEOMETRIC_TOL[ctx.dtype]
        paper_set = max(abs(a / b - 1) for a, b in zip(ordered, sorted(paper_slopes(len(slopes)), reverse=True))) <= tol
        # the paper's set for a head count not a power of two interleaves two geometric runs (BLOOM-176B's 112 heads)
        if ratios and max(ratios) - min(ratios) > tol * max(ratios) and not paper_set:
            return failed("position_bias.not_geometric", round(max(ratios) - min(ratios), 4), ratios=ratios, **facts)
        # in head order: the paper's first head has the largest slope (reversed, a checkpoint's heads would not match);
        # Falcon adds the paper's bias before scaling the scores by 1/sqrt(d_head), so its logits carry the slopes
        # over sqrt(d_head) (tiiuae/falcon-rw-*: alibi=True), trained so
        off = max(abs(a / b - 1) for a, b in zip(slopes, paper_slopes(len(slopes))))
        d_head = ctx.cfg.d_model / len(slopes)
        falcon = max(abs(a * math.sqrt(d_head) / b - 1) for a, b in zip(slopes, paper_slopes(len(slopes))))
        if off > tol and falcon > tol:
            return warned("position_bias.not_paper", round(off, 4), off=off, **facts)
    return passed("position_bias.alibi", None, calls=len(biases), **facts)
