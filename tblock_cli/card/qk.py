"""Spec readers: what happens to q between its projection and the q.k product, read by scaling that projection's own
parameters: a norm (q blind to the scale: per head or over the whole width) or a clamp (OLMo's clip_qkv: q stuck at
+-c once the scale drives it past)."""

from __future__ import annotations

import torch

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.scores import Scores, capture_scores
from tblock_cli.probes import parameters_replaced

# q/k-norm: the derivative of <q, r> along the q projection's own parameters (scaling them), relative to <q, r>: 1 for
# q linear in them, 0 for a normalised q (eps moves it by eps / rms(q)^2: <= 1e-3 at init scales).
NORM_RATIO = 0.5
# A clamp that binds (clip_qkv below the projections' scale) is blind to the scale too, where it binds: OLMo's clip at
# 0.5 on default-init projections measured 0.065. A norm is read below NORMED_RATIO (20x its eps's worst effect),
# and where no share of q's entries sits at exactly its largest magnitude (a norm's outputs have no ties; clamped ones
# do, before a rotation moves them).
NORMED_RATIO = 0.02
CLIPPED_SHARE = 0.01
# clip_qkv, read at position 0 (not yet rotated): q's projection scaled by CLIP_SMALL must leave q linear in it (no norm
# after the clamp, which would make the bound a norm's), scaled by CLIP_LARGE it drives every entry past any clamp, and
# a clamp holds at least CLIP_SHARE of q's entries at exactly one magnitude (measured: all of them under OLMo's clamp
# and the zoo's ClippedQKV; an unclamped q's largest magnitude is one entry among the samples x heads x head_dim of
# position 0, at most 1/16 of them)
CLIP_SMALL, CLIP_LARGE = 1e-6, 1e6
CLIP_SHARE = 0.25
CLIP_TOL = 1e-6
# A weight slice whose gradient is below this share of the largest slice's reaches no head of interest (exact 0).
GRAD_FLOOR = 1e-9


def q_parameters(probe: Probe, call: Scores, q: torch.Tensor) -> list[torch.nn.Parameter]:
    """The parameters of the projection whose output reaches q: the traced source projections, else the one weight
    matrix q depends on (a norm over the whole width can hide the projection from the trace), with its module's own."""
    modules, params = dict(probe.module.named_modules()), dict(probe.module.named_parameters())
    out = []
    for name in call.sources:
        if name in modules:
            out += [p for p in modules[name].parameters(recurse=False)]
        elif name in params:
            out.append(params[name])
    if not out:
        mats = [(n, p) for n, p in params.items() if p.ndim >= 2 and p.dtype.is_floating_point]
        grads = torch.autograd.grad(q.sum(), [p for _, p in mats], retain_graph=True, allow_unused=True)
        reach = [n for (n, _), g in zip(mats, grads) if g is not None and bool(g.abs().max() > 0)]
        if len(reach) == 1:
            owner = reach[0].rpartition(".")[0]
            out = list(modules[owner].parameters(recurse=False)) if owner in modules else [params[reach[0]]]
    return [p for p in out if p.dtype.is_floating_point]


def read_qk_norm(probe: Probe, x: torch.Tensor, call: Scores, index: int) -> Entry:
    """none / head / width: whether q is invariant to scaling its projection (the derivative along the projection's
    own parameters is 0), and if so whether head 0's q depends on other heads' slices of the projection (width)."""
    if call.kind == "mha":
        return Entry("attn.qk_norm", "none", "nn.MultiheadAttention: q is the in-projection, unnormalised")
    live = capture_scores(probe, x, grad=True)
    if index >= len(live) or not live[index].q.requires_grad:
        return skipped("attn.qk_norm", "q does not depend on the block's parameters here")
    q = live[index].q
    params = q_parameters(probe, call, q)
    if not params:
        return skipped("attn.qk_norm", "no one projection reaching q was found")
    r = torch.randn(q.shape, generator=probe.gen, dtype=q.dtype).to(q.device)
    whole = (q * r).sum()
    g_all = torch.autograd.grad(whole, params, retain_graph=True, allow_unused=True)
    g_0 = torch.autograd.grad((q[:, 0] * r[:, 0]).sum(), params, allow_unused=True)
    along = sum((p.detach() * g).sum() for p, g in zip(params, g_all) if g is not None)
    ratio = (along / whole).item() if whole.item() != 0 else float("nan")
    how = f"d<q, r>/d(scale of q's projection) / <q, r> = {ratio:.3g}"
    if abs(ratio - 1) < NORM_RATIO:
        return Entry("attn.qk_norm", "none", how + ": q scales with its projection")
    if abs(ratio) >= NORM_RATIO:
        return skipped("attn.qk_norm", how + ": neither linear nor normalised")
    qa = q.detach().abs()
    tied = (qa == qa.max()).double().mean().item()
    if abs(ratio) >= NORMED_RATIO or tied > CLIPPED_SHARE:
        return skipped("attn.qk_norm", how + f": nearly blind to the scale, not exactly ({tied:.0%} of q's entries at "
                                             f"its largest magnitude): a clamp that binds (clip_qkv), not a norm")
    H = q.shape[1]
    if H < 2:
        return skipped("attn.qk_norm", "one head: a norm per head and over the width are the same")
    narrower = False
    for p, ga, g0 in zip(params, g_all, g_0):
        if ga is None or g0 is None or p.ndim < 2:
            continue
        for axis in range(p.ndim):
            dims = [d for d in range(p.ndim) if d != axis]
            na, n0 = ga.abs().amax(dims), g0.abs().amax(dims)
            if int((n0 > GRAD_FLOOR * n0.max()).sum()) < int((na > GRAD_FLOOR * na.max()).sum()):
                narrower = True
    return Entry("attn.qk_norm", "head" if narrower else "width",
                 how + ": q is normalised; head 0 reads " + ("only its own slice of the projection" if narrower
                                                            else "every head's slice (a norm over the whole width)"))


def read_clip(probe: Probe, x: torch.Tensor, call: Scores, index: int) -> Entry:
    """The clamp on q (OLMo's, DBRX's, MPT's clip_qkv): with q's projection scaled far up, q at position 0 (turned by no
    rotation) sits at +-c in most entries where a clamp binds, and grows with the scale where none does."""
    if call.kind == "mha":
        return Entry("attn.clip", "none", "nn.MultiheadAttention: q is the in-projection, unclamped")
    live = capture_scores(probe, x, grad=True)
    if index >= len(live) or not live[index].q.requires_grad:
        return skipped("attn.clip", "q does not depend on the block's parameters here")
    params = q_parameters(probe, call, live[index].q)
    if not params:
        return skipped("attn.clip", "no one projection reaching q was found")
    named = {n: p for n, p in probe.module.named_parameters() if any(p is q for q in params)}

    def q0(factor: float) -> torch.Tensor | None:
        with parameters_replaced(named, list(named), lambda _n, p: p * factor):
            got = capture_scores(probe, x)
        return got[index].q[..., 0, :].detach() if index < len(got) else None

    small, double, large = q0(CLIP_SMALL), q0(2 * CLIP_SMALL), q0(CLIP_LARGE)
    if small is None or double is None or large is None:
        return skipped("attn.clip", "the q.k product was not found again in a second forward")
    if not bool(small.abs().max() > 0):
        return skipped("attn.clip", "q is zero at position 0")
    if ((double - 2 * small).abs().max() / (2 * small).abs().max()).item() > 1e-6:
        return skipped("attn.clip", "q is not linear in its projection's scale where small (a norm after any clamp)")
    top = large.abs().max()
    share = (large.abs() >= top * (1 - 1e-12)).double().mean().item()
    how = f"q at position 0 with its projection scaled {CLIP_LARGE:g}x: {share:.0%} of its entries at its largest magnitude"
    if share >= CLIP_SHARE:
        return Entry("attn.clip", round(top.item(), 9), how + f" {top.item():.6g} (a clamp)", CLIP_TOL)
    return Entry("attn.clip", "none", how + f" (it grew {(top / small.abs().max()).item():.3g}x: no clamp)")
