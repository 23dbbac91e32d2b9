"""Checks of attention itself: its scores (scaled, normalised over the keys, each token seeing itself) and its cache."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context, eval_forwards, nonfinite_kind
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import beyond, rel_diff, train_mode, update_share

# Attention logits' std against what q.k/sqrt(d_head) predicts from the projections' outputs:
# ~1 when scaled (measured 0.96-1.07 on every correct block of the sweep), sqrt(d_head) when the
# 1/sqrt(d_head) is missing (4 at d_head 16, 8 at d_head 64). The limit sits between them on a log scale:
# d_head^(1/4), and at least 2 (2 at d_head 16, 2.83 at d_head 64), so logits a learned map doubles at init
# (x-transformers' talking heads, `sim + conv(sim)`) are not read as unscaled where heads are wide enough to tell.
UNSCALED_RATIO = 2.0


def unscaled_limit(head_dim: int) -> float:
    return max(UNSCALED_RATIO, head_dim**0.25)

# Below this the scores are scaled more than 1/sqrt(d_head): 1/sqrt(d_model) gives 1/sqrt(n_heads)
# (0.5 at 4 heads, 0.35 at 8), the scale applied twice 1/sqrt(d_head) (0.25 at d_head 16). Correct
# blocks measured 0.91 or more. (muP's deliberate 1/d_head scale lands here too: the warning says so.)
OVERSCALED_RATIO = 0.6
# Attention saturated as built: every query's weight on one key (mean row entropy below this share of uniform's and
# mean largest weight above SATURATED_MAX_P), so the softmax passes almost no gradient and no head can learn where to
# look. Measured at init: correct blocks of the zoo and the 89 driven hf types 0.8 or more, unscaled scores 0.42;
# q/k projections drawn with std 1 (an init meant for embeddings) 0.02.
SATURATED_ENTROPY = 0.1
SATURATED_MAX_P = 0.9
# ... where the q.k part of the logits is what saturates them: a position bias drawn large (x-transformers'
# RelativePositionBias, N(0, 1) times sqrt(d_head): logit std 7.7 at d 64, 8.1 at d 512, its q.k part 0.33 at both) is
# a prior on where to look that training moves, not q/k weights initialised too large (std-1 projections, the zoo's
# SaturatedInit: q.k part 35 at d 32, 70 at d 64, 512 at d 512; correct blocks 0.34)
QK_CALM = 2.0
# A softmax is the same function of s and of s - max(s): PyTorch's own, and a hand-written one that subtracts the row
# maximum, are finite at any logit. One written as exp(s) / sum(exp(s)) overflows once a logit passes 88.7 (float32),
# 11.1 (float16): inf / inf = NaN, as soon as training grows the logits. Probed where the block computes its own
# softmax (not SDPA's or nn.MultiheadAttention's): its q operand scaled so the largest |logit| reaches OVERFLOW_LOGIT
# (the product still fits float16), and the output must stay finite.
OVERFLOW_LOGIT = 1e3
# A scale the block says it applies (Granite's `attention_multiplier` 1/d_head, an attention module's `scaling`) is
# its design, not an accident: where the measured ratio lies within this factor of the one the claim predicts
# (sqrt(d_head / X) for the card's attn.scale X), the scale is not warned of; `spec` judges the claim itself closely.
DECLARED_SCALE_FACTOR = 1.5
# The weights that reach the values, still a distribution and an increasing function of the softmax's output in each
# row, whose log-spread is not the softmax's: the scores' temperature changed after the softmax. A second softmax over
# the probabilities reads ~1/keys (0.10 over 10 keys, 0.17 causal: fewer keys per row); renormalised masks and top-k
# keep every log-difference (1 exactly).
REWEIGHT_FACTOR = 1.5
# The scale is judged only where a head has enough channels for the ratio to mean something.
MIN_HEAD_DIM = 4
# Positions decoded by kv_cache: enough that a window or an off-by-one shows, small enough to be quick.
KV_SEQ = 16
# Positions decoded after the prompt, one token at a time or in chunks of 3: every planted cache bug (a window, a key
# appended twice, positions off by one, a forgotten prompt) shows at the first of them, and each step reads every
# weight (0.1 s at a 7B-size layer).
AFTER_PROMPT = 4


def call_facts(c) -> dict:
    return {"where": c.where or "root", "kind": c.kind, "head_dim": c.head_dim, "logit_std": c.logit_std, "entropy": c.entropy,
            "max_prob": c.max_prob, "scale_ratio": c.scale_ratio}


def check_attention(ctx: Context) -> Outcome:
    """Per attention call: logit std, entropy relative to uniform, mean max probability; unscaled scores warned.

    Catches: per attention call: logit std, entropy relative to uniform, mean max probability; fails on a softmax
    over the query axis, and on a softmax of the block's own that overflows to NaN once its logits reach 1e3 (exp(s) /
    sum(exp(s)) without the row maximum subtracted); **warns** when the scores look unscaled or scaled more than
    1/sqrt(d_head) (not where the block says it applies that scale: muP's 1/d_head kept as Granite's
    `attention_multiplier`), when no token attends to itself (a causal mask that masks the diagonal too, the first
    query's own score reopened or not; the diagonal alone masked in bidirectional scores is Locality Self-Attention's
    design), when the weights that reach the values are the softmax's output made flatter or sharper on the way, each
    row in the same order (log-spread outside 1/1.5 to 1.5x the softmax's: a second softmax over the probabilities,
    ~1/keys), when a q.k product weights the values with no softmax (a softmax
    written out by hand, rows non-negative and summing to 1, counts as one; weights each in [0, 1], a sigmoid per key as
    sigmoid attention has, are its design), and when attention is saturated as built
    (entropy below 0.1 of uniform, each query on one key: q/k weights initialised far too large)"""
    flow = ctx.dataflow()
    slipped = {"tracing_slips": flow.slips, "slip_errors": list(flow.slip_errors)} if flow.slips else {}
    if not flow.attention:
        return skipped("attention.none", **slipped)  # a slip may be why: said, not silently a block without attention
    calls = [call_facts(c) for c in flow.attention]
    scaled = [c for c in flow.attention if c.scale_ratio is not None]
    worst = max(scaled, key=lambda c: c.scale_ratio, default=None)
    value = None if worst is None else round(worst.scale_ratio, 3)
    wrong_axis = next((c for c in flow.attention if not c.key_axis), None)
    if wrong_axis is not None:
        return failed("attention.query_axis", value, where=wrong_axis.where or "root", axis=wrong_axis.axis, calls=calls)
    overflow = softmax_overflows(ctx, flow)
    if overflow is not None:
        return failed("attention.overflows", value, got=overflow, logit=OVERFLOW_LOGIT, calls=calls)
    raw = next((c for c in flow.attention if not c.normalised and not c.gated), None)
    if raw is not None:
        return warned("attention.no_softmax", value, where=raw.where or "root", calls=calls)
    blind = next((c for c in flow.attention if c.self_masked), None)
    if blind is not None:
        return warned("attention.self_masked", value, where=blind.where or "root", calls=calls)
    changed = next((c for c in flow.attention if c.reweighted is not None
                    and not 1 / REWEIGHT_FACTOR <= c.reweighted <= REWEIGHT_FACTOR), None)
    if changed is not None:
        return warned("attention.reweighted", round(changed.reweighted, 3), where=changed.where or "root",
                      factor=changed.reweighted, limit=REWEIGHT_FACTOR, calls=calls)
    odd = [c for c in scaled if c.head_dim >= MIN_HEAD_DIM
           and (c.scale_ratio <= OVERSCALED_RATIO or c.scale_ratio >= unscaled_limit(c.head_dim))]
    declared = declared_scale(ctx) if odd else None
    if declared is not None and all(_as_declared(c, declared) for c in odd):
        return passed("attention.declared_scale", value, declared=declared[0], source=declared[1], calls=calls)
    low = min(scaled, key=lambda c: c.scale_ratio, default=None)
    if low is not None and low.scale_ratio <= OVERSCALED_RATIO and low.head_dim >= MIN_HEAD_DIM:
        return warned("attention.overscaled", round(low.scale_ratio, 3), where=low.where or "root", ratio=low.scale_ratio,
                      limit=OVERSCALED_RATIO, calls=calls)
    over = [c for c in scaled if c.scale_ratio >= unscaled_limit(c.head_dim) and c.head_dim >= MIN_HEAD_DIM]
    if over:
        worst = max(over, key=lambda c: c.scale_ratio)
        return warned("attention.unscaled", round(worst.scale_ratio, 3), where=worst.where or "root", ratio=worst.scale_ratio,
                      note=worst.scale_note.text, head_dim=worst.head_dim, limit=unscaled_limit(worst.head_dim), calls=calls)
    hot = min(flow.attention, key=lambda c: c.entropy)
    qk = hot.scale_note.qk_std
    if hot.entropy < SATURATED_ENTROPY and hot.max_prob > SATURATED_MAX_P and not (qk is not None and qk < QK_CALM):
        return warned("attention.saturated", round(hot.entropy, 3), where=hot.where or "root", entropy=hot.entropy,
                      max_prob=hot.max_prob, logit_std=hot.logit_std, calls=calls)
    return passed("attention.stats", value, calls=calls)


def declared_scale(ctx: Context) -> tuple[float, str] | None:
    """The score scale a block of the user's says it applies (the card's attn.scale X, and where it says so); None for
    an hf: layer (its family's rules say what is by design) or a block that says nothing of it."""
    from tblock_cli.checks.training import block_claims

    return next(((c.value, c.source) for c in block_claims(ctx) if c.key == "attn.scale"), None)


def _as_declared(c, declared: tuple[float, str]) -> bool:
    expected = (c.head_dim / declared[0]) ** 0.5  # the ratio to 1/sqrt(d_head) of a scale 1/sqrt(X)
    return 1 / DECLARED_SCALE_FACTOR <= c.scale_ratio / expected <= DECLARED_SCALE_FACTOR


def softmax_overflows(ctx: Context, flow) -> str | None:
    """What the output holds (NaN, inf) once the logits of the block's own softmax (a product of q and k, not SDPA or
    nn.MultiheadAttention) are driven to OVERFLOW_LOGIT by scaling q, where it is finite before; None otherwise."""
    if all(c.kind in ("nn.MultiheadAttention", "scaled_dot_product_attention") for c in flow.attention):
        return None
    from tblock_cli.anatomy.mha import MASKED_LOGIT
    from tblock_cli.card.scores import ScoreTracer

    module, x = ctx.subject.module, ctx.x()

    def run(targets=frozenset(), factor=1.0):
        tr = ScoreTracer(module, ctx.cfg.d_model, targets, factor)
        tr.prov.watch(x)  # what reads the input's tokens (a product of two tables is no score)
        with train_mode(module, False), torch.no_grad(), tr:
            out = ctx.subject(x.clone())
        return tr, out

    tr, out = run()
    peaks = {}
    for i, (kind, ordinal, *_rest) in tr.calls.items():
        got = tr.attn.captured.get(i)
        if kind in ("sdpa", "mha") or got is None:
            continue
        z = got.logits
        live = z[torch.isfinite(z) & (z > MASKED_LOGIT)]
        if live.numel() and live.abs().max() > 0:
            peaks[ordinal] = live.abs().max().item()
    if not peaks or not torch.isfinite(out).all():
        return None
    _, driven = run(frozenset(peaks), OVERFLOW_LOGIT / min(peaks.values()))
    return None if torch.isfinite(driven).all() else nonfinite_kind(driven)


def decoded_off(got: torch.Tensor, full: torch.Tensor, x: torch.Tensor, label: str) -> tuple[Outcome | None, list, list]:
    """Per position, how far decoded outputs are from the full forward's (rel_diff), and as a share of the block's
    update y - x where that difference is above the output's rounding (0 where not); a kv_cache.shape failure instead
    where their shapes differ."""
    if got.shape != full.shape:
        return failed("kv_cache.shape", list(got.shape), split=label, got=list(got.shape), expected=list(full.shape)), [], []
    per_pos = [rel_diff(got[:, t], full[:, t]) for t in range(full.shape[1])]
    shares = [update_share(got[:, t], full[:, t], x[:, t]) for t in range(full.shape[1])]
    return None, per_pos, shares


def first_off(per_pos: list, shares: list, tol: float) -> int | None:
    """The first position whose decoded output differs (`beyond`)."""
    return next((t for t, (d, u) in enumerate(zip(per_pos, shares)) if beyond(d, u, tol)), None)


def check_kv_cache(ctx: Context) -> Outcome:
    """Decoding with the block's cache equals the full causal forward at every position, for two chunkings, decoded
    in turns: one sequence a prompt then one token at a time, the other the same prompt length then chunks of 3,
    each with its own cache.

    Catches: with `--causal` and a `decode` method: cached decoding that differs from the full forward (beyond the
    tolerance, or beyond 1 % of what the block adds to its input there, where the output is mostly the input:
    LayerScale started at 1e-5); a graph growing across steps; caches that share state ([decoding.md](decoding.md))"""
    from tblock_cli.subject import kvcache

    if not ctx.cfg.causal:
        return skipped("kv_cache.not_causal")
    module = ctx.subject.module
    if not kvcache.has_decode(module):
        return skipped("kv_cache.no_decode")
    T = max(ctx.cfg.seq, KV_SEQ)
    x, xb = ctx.x(seq=T), ctx.x(seq=T)
    # Both sequences start with the same prompt length, so state kept on the module by position or by length (not by
    # sequence) is met by the other sequence at the very next step.
    prompt, rest = T - AFTER_PROMPT, AFTER_PROMPT
    splits = {"prefill + one token at a time": [prompt] + [1] * rest,
              "prefill + chunks of 3": [prompt] + [3] * (rest // 3) + ([rest % 3] if rest % 3 else [])}
    runs = [(label, sizes, seq, full) for (label, sizes), seq, full in zip(splits.items(), (x, xb), eval_forwards(ctx, [x, xb]))]
    worst, cache = 0.0, None
    with train_mode(module, False), torch.no_grad():
        # In turns, not one after the other: every step reads all the weights (0.1 s at a 7B-size layer), and a cache
        # shared between the two shows from the second sequence's first chunk. Only a sequence that differs is decoded
        # again alone, to tell shared state from a wrong cache.
        ctx.step("two sequences in turns")
        decoded = kvcache.decode_in_turns(module, [(seq.clone(), sizes) for _, sizes, seq, _ in runs])
        ctx.subject.ran(sum(len(sizes) for _, sizes, _, _ in runs))
        for (label, sizes, seq, full), (got, cache) in zip(runs, decoded):
            wrong, per_pos, shares = decoded_off(got, full, seq, label)
            if wrong is None and first_off(per_pos, shares, ctx.tol) is not None:
                ctx.step(f"decoding {label} alone")
                wrong_alone, alone, alone_shares = decoded_off(kvcache.decode_chunks(module, seq.clone(), sizes)[0], full,
                                                               seq, label)
                ctx.subject.ran(len(sizes))
                if wrong_alone is None and first_off(alone, alone_shares, ctx.tol) is None:
                    return failed("kv_cache.shared", max(per_pos), diff=max(per_pos))
                wrong, per_pos, shares = wrong_alone, alone, alone_shares
            if wrong is not None:
                return wrong
            bad = first_off(per_pos, shares, ctx.tol)
            if bad is not None:
                return failed("kv_cache.differs", max(per_pos), split=label, position=bad, diff=per_pos[bad],
                              worst=max(per_pos), update_share=shares[bad])
            graphs = [t for t in [got, *kvcache.cache_tensors(cache)] if t.grad_fn is not None]
            if graphs:
                return failed("kv_cache.graph", len(graphs), split=label, tensors=len(graphs))
            worst = max(worst, max(per_pos))
    return passed("kv_cache.equal", worst, worst=worst, bytes=kvcache.cache_bytes(cache), positions=T)
