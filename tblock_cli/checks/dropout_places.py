"""Where a dropout sits: on a branch and on the attention probabilities, as inverted dropout's mean-preserving masks
need; not on the residual stream (the identity path cut) nor on the scores a softmax reads (a zeroed score is no
dropped key, and the rescale sharpens the weights)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tblock_cli.anatomy.mha import MASKED_LOGIT
from tblock_cli.checks.context import Context
from tblock_cli.checks.gradients import RESIDUAL_MIN
from tblock_cli.checks.positions import captured_scores
from tblock_cli.checks.result import Outcome, failed, warned
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import TorchDropoutOff, f64, reseed

# The stream test's central-difference step, in units of the input's RMS (the gain's curvature error is O(step^2)),
# and how much of the eval forward's identity gain must survive every dropout dropping all: a dropout on a branch
# keeps all of it (Pre-LN: exactly the identity), one on the stream none (measured: 0.0).
STREAM_STEP = 1e-2
STREAM_SHARE = 0.25
# Scores of a training forward that are the eval forward's times one factor, to this (relative to the largest): a
# dropout's rescale rounds to ~1e-7 in float32; noise or a dropout before the projections moves them by far more.
SCORES_TOL = 1e-4
PROBE_SCORES_SEED = 11
# A block's own words for the rate of the dropout on attention's probabilities (fairseq's, Megatron's, Hugging Face's,
# GPT-2's, BERT's, nanoGPT's and timm's names): read from its constructor's arguments, configs among them, its
# modules' float attributes and the nn.Dropout modules so named.
ATTENTION_DROPOUTS = ("attention_dropout", "attn_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_drop",
                      "attn_drop_rate", "attention_dropout_prob", "attention_dropout_rate", "attn_dropout_rate",
                      "attn_dropout_p", "attn_drop_prob", "dropout_attn")
# ... and for the dropout on each sublayer's output before its add (GPT-2's resid_pdrop, BERT's hidden_dropout_prob,
# Megatron's hidden_dropout, nanoGPT's resid_dropout, timm's proj_drop)
RESIDUAL_DROPOUTS = ("resid_pdrop", "resid_dropout", "residual_dropout", "hidden_dropout", "hidden_dropout_prob",
                     "hidden_dropout_rate", "residual_dropout_prob", "proj_drop")
# a rate said and a rate applied are the same number where they differ by less than this (a float32 round trip)
RATE_TOL = 1e-6


def on_stream(ctx: Context, run, module: nn.Module, x: torch.Tensor) -> Outcome | None:
    """A dropout on the residual stream (`x = drop(x + f(x))`, `x = drop(x) + f(x)`): with torch's elementwise
    dropouts dropping everything, tr(J)/n of x -> output, which a dropout on a branch leaves at the identity's
    (Pre-LN: the output is x itself), falls below STREAM_SHARE of the eval forward's. Read by central differences
    (two forwards each, no backward): the gain is a derivative of the forward alone."""
    if not x.is_floating_point():
        return None
    gen = torch.Generator().manual_seed(0)
    u = (torch.randint(0, 2, x.shape, generator=gen) * 2 - 1).to(device=x.device, dtype=x.dtype)
    eps = STREAM_STEP * f64(x).pow(2).mean().sqrt().item()
    n = u.numel()

    def gain(train: bool) -> float:
        mode = (lambda: TorchDropoutOff(drop_all=True)) if train else (lambda: None)
        try:
            up, down = (run(module, train, 0, mode(), x + s * eps * u) for s in (1, -1))
        except Exception as e:  # noqa: BLE001 - a block that refuses everything dropped (a finiteness assert, a
            if is_out_of_memory(e):  # sampled router over dropped probabilities): not judged
                raise
            return float("nan")
        if up.shape != x.shape:
            return float("nan")
        return ((f64(up) - f64(down)) * f64(u)).sum().item() / (2 * eps * n)

    dropped = gain(True)
    if not dropped < STREAM_SHARE * RESIDUAL_MIN:
        return None
    kept = gain(False)
    if not (kept >= RESIDUAL_MIN and dropped < STREAM_SHARE * kept):
        return None
    return failed("dropout.stream", round(dropped, 4), gain=dropped, eval_gain=kept, share=STREAM_SHARE)


def on_scores(ctx: Context, subject, x: torch.Tensor) -> Outcome | None:
    """A dropout on attention's scores before the softmax: in a training forward (torch's dropouts on), some of the
    finite scores a softmax reads are exactly 0 where the eval forward's are not, and every other one is the eval
    score times one constant (inverted dropout's 1 / (1 - p); 1 for a mask not rescaled). A zeroed score is not a
    dropped key (that takes -inf, as DropKey masks), and the rescaled ones sharpen the softmax: the mean over masks of
    the weights is not the eval weights. None where no softmax's scores show it."""

    def captured(train: bool) -> list:
        reseed(PROBE_SCORES_SEED)
        return captured_scores(ctx, x, subject, train)[0]

    if not _softmax_attention(ctx):
        return None  # sdpa and nn.MultiheadAttention drop the probabilities by construction
    try:
        want, got = captured(False), captured(True)
    except Exception as e:  # noqa: BLE001 - a block the tracer cannot follow: no evidence either way
        if is_out_of_memory(e):
            raise
        return None
    for (call, e), (_, t) in zip(want, got):
        if e is None or t is None or e.logits.shape != t.logits.shape or call.kind != "softmax(QK^T)V":
            continue
        e_, t_ = e.logits, t.logits
        live = torch.isfinite(e_) & (e_ > MASKED_LOGIT) & torch.isfinite(t_)
        zeroed = live & (t_ == 0) & (e_ != 0)
        kept = live & (t_ != 0)
        if not zeroed.any() or not kept.any():
            continue
        c = (t_[kept] * e_[kept]).sum() / e_[kept].pow(2).sum()  # the one factor, least squares
        off = ((t_[kept] - c * e_[kept]).abs().max() / e_[kept].abs().max()).item()
        if off <= SCORES_TOL and c.item() >= 1 - SCORES_TOL:
            share = zeroed.sum().item() / live.sum().item()
            return failed("dropout.on_scores", round(share, 3), where=call.where or "root", zeroed=share,
                          factor=c.item(), off=off)
    return None


def never_applied(ctx: Context, module: nn.Module, asked: TorchDropoutOff, diff: float) -> Outcome | None:
    """A block of the user's built with a dropout rate above 0 that keeps torch dropout modules at a rate above 0, and
    whose training forward asked no dropout of torch's to drop anything while it drew nothing of its own (the caller
    saw two training forwards equal to eval): the rate it takes is ignored (its nn.Dropout defined, never called).
    None otherwise; hf: layers take their rates from a config of several dropout fields, and are not judged so."""
    from tblock_cli.subject.loading import ALIASES, constructed_arguments

    if asked.calls or ctx.subject.name.startswith("hf:"):
        return None
    built = constructed_arguments(ctx.subject.module)
    rate = next((built[k] for k in ALIASES["dropout"] if isinstance(built.get(k), float)), None)
    idle = [n for n, m in module.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if not rate or not idle:
        return None
    return warned("dropout.never_applied", diff, rate=rate, modules=idle)


def attention_ignored(ctx: Context, module: nn.Module, asked: TorchDropoutOff, x: torch.Tensor) -> Outcome | None:
    """A block of the user's that says it drops attention's probabilities at a rate above 0 (ATTENTION_DROPOUTS), whose
    training forward with torch's dropouts off is deterministic (every draw is torch's: the caller saw two equal) and
    asked none to drop them: SDPA and nn.MultiheadAttention called with dropout_p 0, no elementwise dropout on a
    (..., T, T or more keys) tensor. The rate is taken and ignored (transformers' SDPA paths that passed 0). None
    otherwise; hf: layers take their rates from their configs, and are not judged so."""
    if ctx.subject.name.startswith("hf:") or asked.attention_rates:
        return None
    said = _rate_said(ctx, module, ATTENTION_DROPOUTS)
    if said is None:
        return None
    if any(_scores_shaped(s, x) for s in asked.shapes):
        return None
    if not asked.attention_calls and not _softmax_attention(ctx):
        return None  # no attention seen: what it would drop is not known
    rate, where = said
    return failed("dropout.attention_ignored", rate, rate=rate, where=where, attention_calls=asked.attention_calls)


def attention_rate_differs(ctx: Context, module: nn.Module, asked: TorchDropoutOff, x: torch.Tensor) -> Outcome | None:
    """A block of the user's that says it drops attention's probabilities at one rate (ATTENTION_DROPOUTS) and whose
    training forward drops them at others only: SDPA's and MHA's dropout_p, and elementwise dropouts of a (..., T, T or
    more keys) tensor, none at the rate it says (a constant typed where the argument was meant, another argument
    passed). None where no attention probabilities are dropped (attention_ignored's case), and for hf: layers."""
    if ctx.subject.name.startswith("hf:"):
        return None
    scores = [r for r, s in zip(asked.rates, asked.shapes) if _scores_shaped(s, x)]
    applied = sorted(set(asked.attention_rates + scores))
    said = _rate_said(ctx, module, ATTENTION_DROPOUTS) if applied else None
    if said is None or any(abs(r - said[0]) <= RATE_TOL for r in applied):
        return None
    rate, where = said
    return failed("dropout.attention_rate", rate, rate=rate, where=where, applied=applied)


def _scores_shaped(shape: tuple, x: torch.Tensor) -> bool:
    """Whether an elementwise dropout's input of this shape is attention's probabilities for input x: (..., T, T or
    more keys), and not a (B, T, d) tensor of the stream (unless T is d)."""
    T, d = x.shape[1], x.shape[-1]
    return len(shape) >= 3 and shape[-2] == T and shape[-1] >= T and (shape[-1] != d or T == d)


def residual_ignored(ctx: Context, module: nn.Module, asked: TorchDropoutOff, x: torch.Tensor) -> Outcome | None:
    """A block of the user's that says it drops each sublayer's output at a rate above 0 (RESIDUAL_DROPOUTS), whose
    training forward with torch's dropouts off is deterministic and asked no elementwise dropout of a tensor of the
    stream's size (B x T tokens of d_model: a branch's output, in any layout): the rate is taken and ignored; or
    asked such dropouts at other rates only: another rate in its place. None otherwise, and for hf: layers."""
    if ctx.subject.name.startswith("hf:"):
        return None
    said = _rate_said(ctx, module, RESIDUAL_DROPOUTS)
    if said is None:
        return None
    d, n = x.shape[-1], x.numel()
    stream_rates = [r for r, s in zip(asked.rates, asked.shapes) if s and s[-1] == d and math.prod(s) == n]
    streams = len(stream_rates)
    rate, where = said
    if streams == 1 and _form(ctx) == "sequential":  # two sublayers in a row, one output dropped: a port's slip
        return failed("dropout.residual_one_branch", rate, rate=rate, where=where, dropped=len(asked.shapes))
    if streams and not any(abs(r - rate) <= RATE_TOL for r in stream_rates):  # dropped, at another rate only
        return failed("dropout.residual_rate", rate, rate=rate, where=where, applied=sorted(set(stream_rates)))
    if streams:
        return None
    return failed("dropout.residual_ignored", rate, rate=rate, where=where, dropped=len(asked.shapes))


def _form(ctx: Context) -> str | None:
    """The card's residual.form (sequential: the FFN reads attention's output; parallel: both read the stream), or None
    where it is not read (no attention output or FFN input projection seen)."""
    from tblock_cli.card.read import read_card

    entry = read_card(ctx.subject, ctx.cfg, ctx.device, progress=ctx.step, keys=("residual.form",)).get("residual.form")
    return entry.value if entry is not None and entry.read else None


def _rate_said(ctx: Context, module: nn.Module, names: tuple[str, ...]) -> tuple[float, str] | None:
    """(rate, where it is said) for the first of these dropout rates above 0 the block states, or None."""
    from tblock_cli.card.own import fields_of
    from tblock_cli.checks.training import all_modules
    from tblock_cli.subject.loading import constructed_arguments

    def rate(v) -> float | None:
        if isinstance(v, nn.modules.dropout._DropoutNd):
            v = v.p
        return float(v) if isinstance(v, float) and 0 < v < 1 else None

    for field, v, where in fields_of(constructed_arguments(ctx.subject.module), "the constructor's argument"):
        if field in names and rate(v) is not None:
            return rate(v), f"{where} `{field}`"
    for m in all_modules(module):
        for k in names:
            v = vars(m).get(k, m._modules.get(k))
            if rate(v) is not None:
                return rate(v), f"`{type(m).__name__}.{k}`"
    return None


def _softmax_attention(ctx: Context) -> bool:
    try:  # the shared trace (other checks read it too)
        return any(c.kind == "softmax(QK^T)V" for c in ctx.dataflow().attention)
    except Exception as e:  # noqa: BLE001 - a block the tracer cannot follow: no evidence
        if is_out_of_memory(e):
            raise
        return False
