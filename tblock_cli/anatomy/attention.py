"""What one attention computation looks like on the probe input: its record and the statistics of its scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tblock_cli.anatomy.mha import MASKED_LOGIT
from tblock_cli.anatomy.ops import causal_mask

# Rows of attention weights written out by hand must sum to 1 within this (half precision rounds to ~1e-3).
WEIGHT_SUM_TOL = 1e-2


@dataclass(frozen=True)
class ScaleNote:
    """Where an attention call's scale came from, as data; `messages` writes its sentence (`text`)."""

    kind: str  # qk (q and k as they reach the product) | zero (q or k is zero) | cosine (unit rows) | no_softmax | mha
    # | mixed (each head's scores mix other heads' products: talking heads)
    folded: float = 1.0  # a scalar factor applied to q or k on their way to the product
    sdpa: bool = False  # F.scaled_dot_product_attention scaled it
    passed: float | None = None  # the scale sdpa was passed (None: its default 1/sqrt(E))
    qk_std: float | None = None  # the std of the q.k part of the logits (an additive bias, a mask taken out), where read

    @property
    def text(self) -> str:
        from tblock_cli.messages.words import scale_note

        return scale_note(self)


@dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One attention computation seen on the probe input (built by keyword: nineteen fields read best named)."""

    kind: str  # nn.MultiheadAttention | scaled_dot_product_attention | softmax(QK^T)V
    where: str  # the module it ran in
    q: tuple[str, ...]  # projections whose outputs reach the queries
    k: tuple[str, ...]
    v: tuple[str, ...]
    heads: int
    head_dim: int
    batch: int
    q_len: int
    k_len: int
    logit_std: float  # std of the scores over unmasked entries
    entropy: float  # mean row entropy / log(keys allowed): 1 = uniform
    max_prob: float  # mean over rows of the largest attention weight
    scale_ratio: float | None  # logit std / (rms(q) rms(k)) from the projections: 1 at 1/sqrt(d_head), sqrt(d_head) unscaled
    scale_note: ScaleNote  # where the scale came from
    flops: int  # scores + weighted sum, multiply-add = 2
    kv_width: int = 0  # key + value elements per token: what a decoding cache keeps for this call
    key_axis: bool = True  # the softmax normalises over the keys (the last axis), as attention must
    axis: str = "key"  # the axis it normalises over: key, query, head (of (B, H, L, S) scores), batch, or another
    self_masked: bool = False  # L == S and every query's own position is masked: no token attends to itself
    normalised: bool = True  # the weights multiplied into the values are non-negative and each row sums to 1
    gated: bool = False  # not normalised: a sigmoid of the q.k product per key (sigmoid attention), by design
    # the spread of log(weights reaching the values) over that of log(softmax output), where the weights are still a
    # distribution, changed, and a per-row increasing function of the softmax's: 1 for the softmax itself, a renormalised
    # mask or top-k (same log-differences); ~1/keys for a second softmax over the probabilities. None: not measured
    reweighted: float | None = None



@dataclass(frozen=True)
class Captured:
    """One attention call's scores as a capturing trace keeps them: the logits the softmax reads (biases and masks
    in; float64, CPU) and the q.k product alone, where it was seen (None otherwise); and how far apart the rows of the
    values it was given are (`rows_spread`), where torch was handed them (sdpa)."""

    logits: torch.Tensor
    product: torch.Tensor | None
    values_spread: float | None = None


def rows_spread(t: torch.Tensor) -> float:
    """The largest difference between rows of the middle half of t's positions (axis -2), over t's largest entry: 0
    for values of identical tokens (v = x W_v), whatever the scores do."""
    t = t.detach().double().cpu()
    n = t.shape[-2]
    middle = t[..., n // 4: 3 * n // 4, :]
    return ((middle - middle[..., :1, :]).abs().max() / t.abs().max().clamp_min(1e-300)).item() if middle.numel() else 0.0


def rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


# q and k rows of L2 norm 1 to this (relative): cosine attention (x-transformers' attn_qk_norm, Swin v2), whose scores are
# scaled by a temperature (10, learned), not 1/sqrt(d_head); F.normalize gives 1 to 1e-7. An RMS-normed q (Qwen3,
# OLMo-2) has rows of norm sqrt(d_head) and stays judged.
UNIT_TOL = 0.01


def unit_rows(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether every query (q's last axis) and every key (k's last axis, or its columns: the operand of q @ k^T) has
    L2 norm 1: the q and k of cosine attention."""
    def unit(t, dim):
        n = t.detach().double().norm(dim=dim)
        return n.numel() > 0 and bool(((n - 1).abs() <= UNIT_TOL).all())

    return q.ndim >= 1 and k.ndim >= 2 and unit(q, -1) and (unit(k, -1) or unit(k, -2))


def self_masked(logits: torch.Tensor) -> bool:
    """Square scores whose diagonal is masked everywhere, with one triangle beside it: a causal mask built with triu(0)
    instead of triu(1). The first query's own score may be open (the fix that keeps its row from having no key at all,
    and NaN). The diagonal alone masked, keys open on both sides, is a design: Locality Self-Attention
    (Lee et al. 2021, "Vision Transformer for Small-Size Datasets") masks each token's own score on purpose."""
    if logits.ndim < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] < 2:
        return False
    s = logits.detach().double()
    masked = ~(torch.isfinite(s) & (s > MASKED_LOGIT))
    if not masked.diagonal(dim1=-2, dim2=-1)[..., 1:].all():
        return False
    upper = torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool, device=s.device).triu(1)
    return bool(masked[..., upper].all() or masked[..., upper.T].all())


# Where two samples' scores differ by one multiple of their q.k products' difference (per call), the misfit is rounding
# (1e-8 in float32); talking heads (a learned map over heads before the softmax, CaiT's randn(h, h)) mix the other
# heads' products into each head's scores and leave O(1): no one slope is the scale, and none is judged.
QK_FIT_TOL = 0.05


def qk_std(logits: torch.Tensor, product: torch.Tensor) -> float | None:
    """The std of the part of the scores that the q.k product explains: the scores regressed on the product over the
    unmasked entries. An additive bias (ALiBi, a relative bias) is uncorrelated with a random input's product and
    drops out; with no bias this is the std of the scores themselves. Where the scores lead with two samples, the
    slope comes from their difference, in which an input-independent bias cancels exactly: over the few hundred
    entries of 10 tokens, a large learned bias's chance correlation with the product moves the plain regression's
    slope by up to 3x (x-transformers' relative bias, 7.7x the q.k part's std). None where that difference is no one
    multiple of the products' (misfit above QK_FIT_TOL): the heads' scores are mixed, and no slope is the scale."""
    z = logits.detach().double()
    valid = torch.isfinite(z) & (z > MASKED_LOGIT)
    zv = z[valid]
    try:
        p = product.detach().double().to(z.device).expand_as(z)
    except RuntimeError:  # a product laid out otherwise (heads folded into the batch): the scores as they are
        return zv.std().item() if zv.numel() > 1 else 0.0
    pv = p[valid]
    if zv.numel() < 2 or pv.var() == 0:
        return zv.std().item() if zv.numel() > 1 else 0.0
    slope = None
    if z.ndim == 4 and z.shape[0] == 2:  # (batch 2, heads, L, S): the two samples' difference
        both = valid[0] & valid[1]
        dz, dp = (z[0] - z[1])[both], (p[0] - p[1])[both]
        if dz.numel() > 1 and (dp * dp).sum() > 0:
            slope = (dz * dp).sum() / (dp * dp).sum()
            if (dz - slope * dp).norm() > QK_FIT_TOL * dz.norm():
                return None
    if slope is None:
        slope = ((zv - zv.mean()) * (pv - pv.mean())).mean() / pv.var(unbiased=False)
    return (slope.abs() * pv.std()).item()


def row_centred(product: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A tensor of scores (the q.k product, or the logits read back from written-out weights as log W) less its mean
    over each row's valid entries: log W is the logits up to a constant per row, and the product centred the same way
    is what they are a multiple of. A tensor laid out otherwise is returned as it is."""
    try:
        p = product.detach().double().to(valid.device).expand(valid.shape)
    except RuntimeError:
        return product
    return p - p.masked_fill(~valid, 0).sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp_min(1)


def sigmoid_of(W: torch.Tensor, product: torch.Tensor) -> bool:
    """Whether weights W (..., L, S) are a sigmoid of an affine map of the q.k product, per leading slice (sigmoid
    attention: logit(W) = a q.k + b to QK_FIT_TOL over the entries in (0, 1); masked ones, 0, left out). Weights that
    merely lie in [0, 1] are not: an exp(s - max) whose division was forgotten (each row's largest weight 1), a softmax
    over the queries (one offset per key), a mask applied after a softmax."""
    W = W.detach().double()
    if W.ndim < 2 or not bool(((W >= -1e-6) & (W <= 1 + 1e-6)).all()):
        return False
    try:
        p = product.detach().double().to(W.device).expand(W.shape)
    except RuntimeError:
        return False
    inside = (W > 1e-9) & (W < 1 - 1e-9)
    z = torch.log(W.clamp(1e-300, 1)) - torch.log1p(-W.clamp(0, 1 - 1e-16))
    for zs, ps, ms in zip(z.reshape(-1, *W.shape[-2:]), p.reshape(-1, *W.shape[-2:]), inside.reshape(-1, *W.shape[-2:])):
        zv, pv = zs[ms], ps[ms]
        if zv.numel() < 3 or pv.var() == 0:
            return False
        A = torch.stack((pv, torch.ones_like(pv)), 1)
        fit = A @ torch.linalg.lstsq(A, zv[:, None]).solution[:, 0]
        if (zv - fit).norm() > QK_FIT_TOL * (zv - zv.mean()).norm().clamp_min(1e-300):
            return False
    return True


def uniform_rows(t: torch.Tensor) -> bool:
    """Every row (token) of t equal: on an input of identical tokens, no position has entered yet."""
    rows = t.detach().double().reshape(-1, t.shape[-1])
    return bool((rows - rows[:1]).abs().max() <= 1e-3 * rows.abs().max().clamp_min(1e-30))


def score_stats(logits: torch.Tensor) -> tuple[float, float, float]:
    """(std of unmasked logits, entropy relative to uniform, mean max probability) of (..., L, S) scores."""
    z = logits.detach().double()
    valid = torch.isfinite(z) & (z > MASKED_LOGIT)
    vals = z[valid]
    std = vals.std().item() if vals.numel() > 1 else 0.0
    p = torch.softmax(z.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
    n = valid.sum(-1)
    rows = n >= 2
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    rel = (ent[rows] / torch.log(n[rows].double())).mean().item() if rows.any() else 1.0
    return std, rel, p.amax(-1)[n >= 1].mean().item() if (n >= 1).any() else 0.0



def sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The signature of F.scaled_dot_product_attention, to bind its arguments by name."""


def apply_masks(logits: torch.Tensor, attn_mask, is_causal: bool) -> torch.Tensor:
    L, S = logits.shape[-2], logits.shape[-1]
    if is_causal:
        logits = logits.masked_fill(causal_mask(L, S, logits.device), float("-inf"))
    if attn_mask is not None:
        m = attn_mask.detach().to(logits.device)
        if m.dtype == torch.bool:
            logits = logits.masked_fill(~m, float("-inf"))
        else:
            logits = logits + m.double()
    return logits



# Weights equal to the softmax's output to this (absolute): nothing was done to them on the way to the values.
SAME_WEIGHTS = 1e-6


def is_distribution(W: torch.Tensor) -> bool:
    """Weights non-negative whose every live row (not zeroed: a fully masked row carries no weight) sums to 1."""
    rows = W.sum(-1)
    live = rows.abs() > 1e-6
    return bool((W >= -1e-6).all() and live.any() and ((rows[live] - 1).abs() <= WEIGHT_SUM_TOL).all())


def is_sub_distribution(W: torch.Tensor) -> bool:
    """Weights non-negative whose every live row sums to at most 1, some below: a softmax with a sink in its
    denominator, written out (`exp(s) / (1 + sum exp(s))`, quiet attention): log W is still the logits up to each
    row's constant."""
    rows = W.sum(-1)
    live = rows.abs() > 1e-6
    return bool((W >= -1e-6).all() and live.any() and (rows[live] <= 1 + WEIGHT_SUM_TOL).all()
                and (rows[live] < 1 - WEIGHT_SUM_TOL).any())


def reweighting(w: torch.Tensor, p: torch.Tensor) -> float | None:
    """std of log w over std of log p (each row-centred over the entries both keep), where w (the weights that reach
    the values) is a distribution again, differs from p (the softmax's output), and keeps each row's order of p (an
    elementwise increasing map per row: a second softmax, a power; not a mix of heads, talking heads' design)."""
    if w.shape != p.shape or w.ndim < 2 or not w.is_floating_point() or not p.is_floating_point():
        return None
    W, P = w.detach().double(), p.detach().double().to(w.device)
    if not bool(torch.isfinite(W).all()) or (W - P).abs().max().item() <= SAME_WEIGHTS:
        return None
    if not is_distribution(W):
        return None
    order = P.argsort(-1)
    if bool((W.gather(-1, order).diff(dim=-1) < -1e-9).any()):  # not increasing in p within a row: something else
        return None
    valid = (W > 0) & (P > 0)
    lw = row_centred(W.clamp_min(1e-300).log(), valid).masked_fill(~valid, 0)
    lp = row_centred(P.clamp_min(1e-300).log(), valid).masked_fill(~valid, 0)
    spread = lp.pow(2).sum().sqrt().item()
    return lw.pow(2).sum().sqrt().item() / spread if spread > 1e-12 else None
