"""Spec readers: the attention entries of the card (heads, key/value heads, head dim, score scale, soft-cap, sliding
window, causal, q/k-norm), read off the q.k product of each attention call and what becomes of it before softmax."""

from __future__ import annotations

import torch

from tblock_cli.anatomy.attention import unit_rows
from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.qk import read_clip, read_qk_norm
from tblock_cli.card.scores import Scores, capture_scores
from tblock_cli.probes import parameters_replaced

# the entries read by probing the scores (the rest are sizes, read off the first call as it is)
PROBED = ("attn.scale", "attn.softcap", "attn.window", "attn.qk_norm", "attn.clip")
KEYS = ("attn.heads", "attn.kv_heads", "attn.group", "attn.kv_grouping", "attn.head_dim", "attn.scale", "attn.softcap", "attn.window", "attn.qk_norm", "attn.clip")
# Tokens of the random input the scores are read on: enough entries per head for the fits below.
SCALE_SEQ = 16
# The q operand is scaled so that the largest q.k part of the logits is this: the linear regime of any soft-cap of 5 or
# more (tanh bends it by (0.1/c)^2/3 <= 1.3e-4), and far above the float32 rounding of a bias cast before softmax
# (mpt's scores read at a q factor of 1e-3 came back 1e-4 off; at this size 1e-6).
LINEAR_LOGIT = 0.1
# X of 1/sqrt(X), relative. Measured in float64 on hf: llama, gemma2, bloom, mpt, gpt2, bert, qwen3, gpt_neox, t5 and the
# zoo: <= 1e-5 off the config's value. The smallest real bug: gemma2-27b's query_pre_attn_scalar 144 read as head_dim
# 128 (12.5%); 1/sqrt(d/h) against 1/sqrt(head_dim) where they differ: >= 25%.
SCALE_TOL = 0.03
# The slope's relative change with every parameter scaled by ~10 % above which the scale is learned. Measured: 17 HF
# layers and 6 zoo and x-transformers blocks with a fixed scale <= 1.6e-7 (a soft-cap's tanh; most 0 to 3e-16);
# x-transformers' talking heads (identity-initialised, added to the scores) 0.016.
LEARNED_TOL = 1e-3
# Said of a scale read where q and k reach the product as unit vectors: a bare `scale` attribute beside them claims
# nothing (x-transformers keeps dim_head ** -0.5 and scales cosine scores by qk_norm_scale).
COSINE = "; q and k reach it as unit vectors (cosine attention: the scale is a temperature)"
# The logits' change, as q is scaled, is one multiple of q.k to this (relative RMS). Measured: 17 HF layers and 5 zoo
# and x-transformers blocks <= 1.8e-6 (a soft-cap's tanh; mpt's float32 ALiBi 1.2e-6); talking heads (a learned map over heads before the
# softmax, randomly initialised) 0.84. x-transformers' own start as the identity added to the scores: no mixing to see
# (the logits read twice the scale), but the slope moves with their weights (LEARNED_TOL).
FIT_TOL = 0.05
# Logits are driven to this size (the q.k part), and to ten times it: a soft-cap holds them (c * tanh saturates at c),
# an unbounded block grows tenfold. Caps up to ~1e3 are read exactly (tanh(10) = 1 - 4e-9); a larger one reads as none.
CAP_LOGIT = 1e3
# Growth of the largest logit between the two drives below which the logits are bounded (unbounded: 10x).
CAP_GROWTH = 1.5
# Keys seen by every later query that the window's reading leaves out (attention sinks): at most this many, or a
# sixteenth of the probe.
FEW_SINKS = 8
# The cap c, relative: read to tanh's saturation (<= 1e-8 at CAP_LOGIT for c <= 50); a cap missing reads none.
CAP_TOL = 0.01
# Tokens the mask is read over for a sliding window: a window shorter than this is seen (gpt-oss's 128, gemma3's 512;
# mistral's 4096 would need 16M scores per head, and reads none, as its reference does at this length). Wider blocks
# are read over fewer tokens, WINDOW_WORK / d_model, at least WINDOW_MIN: the traced forward at 513 tokens took 4.7 s
# at d_model 1024 (float64, 2 threads), and grows with the width; a reference is read at the same sizes, so the same length.
WINDOW_SEQ = 513
WINDOW_MIN = 129
WINDOW_WORK = 2**19


def window_seq(d_model: int) -> int:
    return max(WINDOW_MIN, min(WINDOW_SEQ, WINDOW_WORK // max(d_model, 1) + 1))
# Earlier outputs changed by a later token by less than this, relative to the output: unchanged (float64: exact 0 where
# masked keys get zero weight; -1e4 masks give exp(-1e4) = 0 in float64 too).
CAUSAL_TOL = 1e-10



def self_calls(probe: Probe, T: int) -> tuple[torch.Tensor, list[tuple[int, Scores]]]:
    """A random input of T tokens and the attention calls of its forward whose scores are square (self-attention),
    each with its index among all the calls read."""
    x = probe.x(1, T)
    probe.forward(x)  # a block that caches per length (x-transformers' ALiBi) settles first: later forwards make the same calls
    return x, [(i, c) for i, c in enumerate(capture_scores(probe, x)) if c.square and c.logits.shape[-1] == T]


def centred(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The valid entries of t, each row centred on its valid entries' mean (a row offset is invisible to softmax)."""
    n = valid.sum(-1, keepdim=True).clamp_min(1)
    return (t.masked_fill(~valid, 0) - t.masked_fill(~valid, 0).sum(-1, keepdim=True) / n)[valid]


def misfit(z: torch.Tensor, fit: torch.Tensor, valid: torch.Tensor) -> float:
    """Relative RMS of z - fit over valid entries, each row centred first."""
    zc = centred(z, valid)
    return ((zc - centred(fit, valid)).norm() / zc.norm().clamp_min(1e-300)).item()


def slope_moved(probe: Probe, x: torch.Tensor, call: Scores, f: float, s: float) -> float | None:
    """The slope's relative change when every parameter is scaled by 1 + 0.1 N(0, 1), element by element (restored
    after): whatever acts on q and k before the product only changes q.k, so a fixed scale keeps its slope; a learned
    one (a temperature, talking heads that start as the identity) moves. None where the call is not found again."""
    params = dict(probe.module.named_parameters())
    names = [n for n, q in params.items() if q.dtype.is_floating_point]
    gen = torch.Generator().manual_seed(11)
    noise = {n: 1 + 0.1 * torch.randn(params[n].shape, generator=gen, dtype=torch.float64) for n in names}
    with parameters_replaced(params, names, lambda n, q: q * noise[n].to(device=q.device, dtype=q.dtype)):
        plain = [c for c in capture_scores(probe, x) if c.ordinal == call.ordinal]
        z0, zf = perturbed(probe, x, call, 0.0), perturbed(probe, x, call, f)
    if not plain or z0 is None or zf is None or plain[0].logits.shape != call.logits.shape:
        return None
    moved = fitted(zf - z0, f * plain[0].product(), plain[0].valid)
    return abs(moved - s) / s


def fitted(z: torch.Tensor, p: torch.Tensor, valid: torch.Tensor) -> float:
    """Least-squares s of z = s * p over valid entries, each row centred first (a row offset is invisible to softmax)."""
    zc, pc = centred(z, valid), centred(p, valid)
    return ((zc * pc).sum() / (pc * pc).sum().clamp_min(1e-300)).item()


def perturbed(probe: Probe, x: torch.Tensor, call: Scores, factor: float) -> torch.Tensor | None:
    """The call's logits in a forward of x with its q operand scaled by factor (None where it is not found again)."""
    got = [c for c in capture_scores(probe, x, frozenset([call.ordinal]), factor) if c.ordinal == call.ordinal]
    return got[0].logits if got else None


def read_scale(probe: Probe, x: torch.Tensor, call: Scores, z0: torch.Tensor | None) -> tuple[Entry, float | None]:
    """X of the score scale 1/sqrt(X): the slope of the logits against q.k (folded factors undone), on the linear
    part: logits at a small q factor minus logits at q = 0 (what stays is the bias and the mask)."""
    p = call.product()
    if call.ordinal < 0:  # nn.MultiheadAttention: its own 1/sqrt(head dim), read from its recomputed scores
        s = fitted(call.logits, p, call.valid)
        return Entry("attn.scale", round(1 / s**2, 6), "nn.MultiheadAttention's scores against q.k", SCALE_TOL), s
    valid = call.valid
    guess = call.q.shape[-1] ** -0.5
    f = LINEAR_LOGIT / max(guess * p[valid].abs().max().item(), 1e-300)
    zf = perturbed(probe, x, call, f)
    if z0 is None or zf is None:
        return skipped("attn.scale", "the q.k product was not found again in a second forward"), None
    s = fitted(zf - z0, f * p, valid)
    if not s > 0:
        return skipped("attn.scale", f"the scores fall with q.k (slope {s:.3g})"), None
    off = misfit(zf - z0, s * f * p, valid)
    if off > FIT_TOL:
        return skipped("attn.scale", f"the logits are no one multiple of each head's q.k (off by {off:.2g}): heads mixed "
                                     f"before the softmax (talking heads)"), None
    moved = slope_moved(probe, x, call, f, s)
    if moved is not None and moved > LEARNED_TOL:
        return skipped("attn.scale", f"the slope moves with the block's parameters ({moved:.2g} when each is scaled by "
                                     f"about 10 %): a learned temperature or map over the scores (talking heads) sets "
                                     f"it"), None
    how = (f"slope of the logits on q.k ({call.kind}), q scaled to keep logits near {LINEAR_LOGIT}, minus the "
           f"logits at q = 0" + (f"; a factor {call.fold:.4g} folded into q, k undone" if call.fold != 1 else "")
           + (COSINE if unit_rows(call.q, call.k) else ""))
    return Entry("attn.scale", round(1 / s**2, 6), how, SCALE_TOL), s


def read_softcap(probe: Probe, x: torch.Tensor, call: Scores, s: float, z0: torch.Tensor | None) -> Entry:
    """Drive the q.k part of the logits to CAP_LOGIT and tenfold: bounded at c (c * tanh(s/c)) or growing (none)."""
    if call.kind in ("sdpa", "mha"):
        return Entry("attn.softcap", "none", f"{call.kind}: the scores are q.k scaled, plus the mask (no cap inside)")
    p = call.product()
    valid = call.valid
    f = CAP_LOGIT / max(s * p[valid].abs().max().item(), 1e-300)
    spans = []
    for factor in (f, 10 * f):
        z = perturbed(probe, x, call, factor)
        if z is None or z0 is None:
            return skipped("attn.softcap", "the q.k product was not found again in a second forward")
        ok = torch.isfinite(z) & (z > -1e300)
        if call.kind == "weights" and not bool((ok | ~valid).all()):
            return skipped("attn.softcap", "the attention weights are written out (exp / sum): driven large, they "
                                           "underflow, so the logits cannot be read there")
        d = (z - z0).masked_fill(~valid, float("nan"))
        row = (d.nan_to_num(float("-inf")).amax(-1) - d.nan_to_num(float("inf")).amin(-1))[valid.sum(-1) > 1]
        spans.append(row.max().item() / 2)
    how = f"the q.k part of the logits driven to {CAP_LOGIT:g} and {10 * CAP_LOGIT:g}: half the widest row spread"
    if spans[1] > CAP_GROWTH * spans[0]:
        return Entry("attn.softcap", "none", how + f" grew {spans[1] / max(spans[0], 1e-300):.3g}x (unbounded)")
    return Entry("attn.softcap", round(spans[1], 6), how + f" stayed at {spans[1]:.6g} (bounded)", CAP_TOL)


def _sinks(valid: torch.Tensor) -> torch.Tensor:
    """Per key of valid (L, S): seen by every query at or after it, and in the first half (so more queries see it
    than any window shorter than half the probe lets see a key): an attention sink."""
    n = min(valid.shape)
    j = torch.arange(n, device=valid.device)
    return (valid[:n, :n].tril().sum(0) == n - j) & (j < n // 2)


def read_window(calls: list[Scores], T: int) -> Entry:
    """The farthest key any query reaches, plus one: a window where that is shorter than the sequence. A few keys
    every later query sees (attention sinks, StreamingLLM's) are left out of the reach where they are few: the window
    is the band the other keys are seen in."""
    reach, kept = [], 0
    for c in calls:
        valid = c.valid.any(0).any(0)  # (L, S): allowed for any sample or head
        sinks = _sinks(valid)
        if 0 < int(sinks.sum()) <= max(FEW_SINKS, len(sinks) // 16):  # a causal mask's every early key is no sink
            band = valid.clone()
            band[:, : len(sinks)][:, sinks] = False
            if band.any():
                valid, kept = band, max(kept, int(sinks.sum()))
        i, j = torch.nonzero(valid, as_tuple=True)
        if not len(i):
            continue
        reach.append(int((i - j).abs().max().item()) + 1)
    if not reach:
        return skipped("attn.window", "no query attends to any key")
    w = min(reach)
    how = f"the farthest key a query reaches over {T} tokens (mask of the scores), plus one"
    if kept and w < T:
        how += f"; {kept} leading key(s) every later query sees left out (attention sinks)"
    return Entry("attn.window", w if w < T else "none", how if w < T else f"no window within {T} tokens")


def read_causal(probe: Probe) -> Entry:
    """Whether earlier outputs ignore a change of the last token."""
    x = probe.x(1, max(probe.cfg.seq, 8))
    x2 = x.clone()
    x2[:, -1] = probe.randn(probe.d)
    a, b = probe.forward(x)[:, :-1], probe.forward(x2)[:, :-1]
    change = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
    # shown, held only against an --expect: a block may take its causal mask from the caller (tblock passes none), and
    # --causal already has its own check
    return Entry("attn.causal", change <= CAUSAL_TOL,
                 f"earlier outputs changed {change:.2g} (relative) when the last token changed", judged=False)


def key_classes(k: torch.Tensor) -> list[int]:
    """For each of the product's key heads (B, H, S, E), the first head equal to it: repeated key heads are equal
    exactly (a copy), distinct ones are not (their projections' weights differ)."""
    tol = 1e-12 * k.abs().max()
    return [int(torch.nonzero((k - k[:, h : h + 1]).abs().amax((0, 2, 3)) <= tol).min()) for h in range(k.shape[1])]


def read_grouping(call: Scores, H: int, kv: int, first: list[int] | None) -> Entry:
    """Which query heads share a key head: contiguous runs (query head h reads key head h // group: transformers'
    repeat_kv, sdpa's enable_gqa, Meta's repeat_interleave), strided (h reads h mod kv_heads: `k.repeat(1, group, 1,
    1)`), or other. Both train; only one reads a checkpoint written for the other."""
    if kv <= 1 or kv >= H:
        return skipped("attn.kv_grouping", "one key head per query head: nothing grouped" if kv >= H
                       else "one key head for every query head: nothing grouped")
    if first is None:
        if call.kind != "sdpa":
            return skipped("attn.kv_grouping", f"{kv} key heads enter a {call.kind} product unrepeated: the grouping is "
                                               "the product's own layout, not read")
        return Entry("attn.kv_grouping", "contiguous", f"{kv} key heads enter sdpa unrepeated (enable_gqa: query head h "
                                                       f"reads key head h // {H // kv})")
    runs: dict[int, list[int]] = {}
    for h, f in enumerate(first):
        runs.setdefault(f, []).append(h)
    g = H // kv
    if H % kv == 0 and all(f == h // g * g for h, f in enumerate(first)):
        value = "contiguous"
    elif H % kv == 0 and all(f == h % kv for h, f in enumerate(first)):
        value = "strided"
    else:
        value = "other"
    shown = ", ".join(str(r) for r in list(runs.values())[:3]) + (", ..." if len(runs) > 3 else "")
    return Entry("attn.kv_grouping", value, f"query heads reading one key head: {shown}")


def read(probe: Probe) -> list[Entry]:
    out = [read_causal(probe)]
    x, calls = self_calls(probe, SCALE_SEQ)
    if not calls:
        return out + [skipped(k, "no self-attention call whose q and k could be read") for k in KEYS]
    index, call = calls[0]
    H, E = call.q.shape[1], call.q.shape[-1]
    k = call.k
    first = key_classes(k) if k.shape[1] == H else None
    heads, why = "distinct key heads", ""
    if first is not None and call.v is not None and call.v.shape[1] == H and (values := key_classes(call.v)) != first:
        # a query head reads a key head and a value head together: where values are grouped unlike the keys (k
        # repeat_interleaved, v repeated), the pairs are the heads, and more of them than the block keeps
        first = [next(g for g in range(H) if (first[g], values[g]) == (first[h], values[h])) for h in range(H)]
        heads, why = "distinct (key, value) head pairs", ": values grouped unlike the keys"
    kv = len(set(first)) if first is not None else k.shape[1]
    # heads written one at a time (nanoGPT's lecture `Head` modules, concatenated; a loop over a projection's slices):
    # every single-head call of the forward a head
    single = [c for _, c in calls if c.q.shape[1] == 1 and c.q.shape[-1] == E] if H == 1 else []
    heads_read = Entry("attn.heads", len(single), f"single-head attention calls ({call.kind}), one q.k product each",
                       judged=False) if len(single) > 1 else Entry("attn.heads", H, f"q.k products per token ({call.kind})",
                                                                     judged=False)
    out += [heads_read,
            Entry("attn.kv_heads", kv, f"{heads} in the product{why}", judged=False),
            Entry("attn.group", H / kv, f"{H} query heads over {kv} {heads}", judged=False) if kv
            else skipped("attn.group", "no key heads read"),
            read_grouping(call, H, kv, first),
            Entry("attn.head_dim", E, "channels of q in the product", judged=False)]
    wanted = probe.memo.get("keys")
    if wanted is not None and not wanted.intersection(PROBED):  # sizes only: no scale, cap or window probe paid for
        return out
    z0 = perturbed(probe, x, call, 0.0) if call.ordinal >= 0 else None  # the bias and the mask alone
    scale, s = read_scale(probe, x, call, z0)
    out.append(scale)
    out.append(read_softcap(probe, x, call, s, z0) if s is not None else skipped("attn.softcap", "the scale was not read"))
    T = window_seq(probe.d)
    try:
        _, long_calls = self_calls(probe, T)
    except Exception as e:  # noqa: BLE001 - a block with a shorter maximum length
        out.append(skipped("attn.window", f"the block refused {T} tokens: {type(e).__name__}"))
    else:
        out.append(read_window([c for _, c in long_calls], T) if long_calls else
                   skipped("attn.window", f"no self-attention call read at {T} tokens"))
    out.append(read_qk_norm(probe, x, call, index))
    if wanted is None or "attn.clip" in wanted:
        out.append(read_clip(probe, x, call, index))
    return out
