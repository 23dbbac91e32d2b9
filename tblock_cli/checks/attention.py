"""Checks of attention itself: its scores (scaled, normalised over the keys, each token seeing itself) and its cache."""

from __future__ import annotations

import torch

from tblock_cli.checks.context import Context, eval_forwards
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import rel_diff, train_mode

# Attention logits' std against what q.k/sqrt(d_head) predicts from the projections' outputs:
# ~1 when scaled (measured 0.96-1.07 on every correct block of the sweep), sqrt(d_head) when the
# 1/sqrt(d_head) is missing (4 at d_head 16, 8 at d_head 64). 2 sits between them on a log scale.
UNSCALED_RATIO = 2.0
# Below this the scores are scaled more than 1/sqrt(d_head): 1/sqrt(d_model) gives 1/sqrt(n_heads)
# (0.5 at 4 heads, 0.35 at 8), the scale applied twice 1/sqrt(d_head) (0.25 at d_head 16). Correct
# blocks measured 0.91 or more. (muP's deliberate 1/d_head scale lands here too: the warning says so.)
OVERSCALED_RATIO = 0.6
# The scale is judged only where a head has enough channels for the ratio to mean something.
MIN_HEAD_DIM = 4
# Positions decoded by kv_cache: enough that a window or an off-by-one shows, small enough to be quick.
KV_SEQ = 16
# Chunks of the first split decoded by two sequences in turns: the prefill and two single tokens (a shared cache
# shows at the first of them, reading the other sequence's prefill).
INTERLEAVED = 3


def call_facts(c) -> dict:
    return {"where": c.where or "root", "kind": c.kind, "head_dim": c.head_dim, "logit_std": c.logit_std, "entropy": c.entropy,
            "max_prob": c.max_prob, "scale_ratio": c.scale_ratio}


def check_attention(ctx: Context) -> Outcome:
    """Per attention call: logit std, entropy relative to uniform, mean max probability; unscaled scores warned."""
    flow = ctx.dataflow()
    if not flow.attention:
        return skipped("attention.none")
    calls = [call_facts(c) for c in flow.attention]
    scaled = [c for c in flow.attention if c.scale_ratio is not None]
    worst = max(scaled, key=lambda c: c.scale_ratio, default=None)
    value = None if worst is None else round(worst.scale_ratio, 3)
    wrong_axis = next((c for c in flow.attention if not c.key_axis), None)
    if wrong_axis is not None:
        return failed("attention.query_axis", value, where=wrong_axis.where or "root", calls=calls)
    raw = next((c for c in flow.attention if not c.normalised), None)
    if raw is not None:
        return warned("attention.no_softmax", value, where=raw.where or "root", calls=calls)
    blind = next((c for c in flow.attention if c.self_masked), None)
    if blind is not None:
        return warned("attention.self_masked", value, where=blind.where or "root", calls=calls)
    low = min(scaled, key=lambda c: c.scale_ratio, default=None)
    if low is not None and low.scale_ratio <= OVERSCALED_RATIO and low.head_dim >= MIN_HEAD_DIM:
        return warned("attention.overscaled", round(low.scale_ratio, 3), where=low.where or "root", ratio=low.scale_ratio,
                      limit=OVERSCALED_RATIO, calls=calls)
    if worst is not None and worst.scale_ratio >= UNSCALED_RATIO and worst.head_dim >= MIN_HEAD_DIM:
        return warned("attention.unscaled", value, where=worst.where or "root", ratio=worst.scale_ratio, note=worst.scale_note,
                      head_dim=worst.head_dim, limit=UNSCALED_RATIO, calls=calls)
    return passed("attention.stats", value, calls=calls)


def check_kv_cache(ctx: Context) -> Outcome:
    """Decoding with the block's cache equals the full causal forward at every position, for two chunkings."""
    from tblock_cli import kvcache

    if not ctx.cfg.causal:
        return skipped("kv_cache.not_causal")
    module = ctx.subject.module
    if not kvcache.has_decode(module):
        return skipped("kv_cache.no_decode")
    T = max(ctx.cfg.seq, KV_SEQ)
    x, xb = ctx.x(seq=T), ctx.x(seq=T)  # xb: the second sequence of the turns below
    full, full_b = eval_forwards(ctx, [x, xb])
    splits = {"prefill + one token at a time": [T // 2] + [1] * (T - T // 2),
              "chunks of 3": [3] * (T // 3) + ([T % 3] if T % 3 else [])}
    worst, cache, first = 0.0, None, None
    with train_mode(module, False), torch.no_grad():
        for label, sizes in splits.items():
            ctx.step(f"decoding {label}")
            got, cache = kvcache.decode_chunks(module, x.clone(), sizes)
            first = got if first is None else first
            if got.shape != full.shape:
                return failed("kv_cache.shape", list(got.shape), split=label, got=list(got.shape), expected=list(full.shape))
            per_pos = [rel_diff(got[:, t], full[:, t]) for t in range(T)]
            bad = next((t for t, d in enumerate(per_pos) if d > ctx.tol), None)
            if bad is not None:
                return failed("kv_cache.differs", max(per_pos), split=label, position=bad, diff=per_pos[bad], worst=max(per_pos))
            graphs = [t for t in [got, *kvcache.cache_tensors(cache)] if t.grad_fn is not None]
            if graphs:
                return failed("kv_cache.graph", len(graphs), split=label, tensors=len(graphs))
            worst = max(worst, max(per_pos))
        # Two sequences decoded in turns (both prefills, then a few tokens of each), each with its own cache, equal
        # each alone: x decoded in the same chunks (the first split's run), xb's full forward (decoding equals the full
        # forward, as the splits above showed). A shared cache shows from the first token after both prefills; each
        # step reads every weight (0.1 s at a 7B-size layer), so the turns stop after INTERLEAVED chunks: 6 steps.
        sizes = next(iter(splits.values()))[:INTERLEAVED]
        n_pos = sum(sizes)
        ctx.step("two sequences in turns")
        alone_b = full_b[:, :n_pos]
        ca = cb = None
        mixed_a, mixed_b, t = [], [], 0
        for n in sizes:
            ya, ca = kvcache.decode_step(module, x[:, t : t + n].clone(), ca)
            yb, cb = kvcache.decode_step(module, xb[:, t : t + n].clone(), cb)
            mixed_a.append(ya)
            mixed_b.append(yb)
            t += n
        first = first[:, :n_pos]
        shared = max(rel_diff(torch.cat(mixed_a, 1), first), rel_diff(torch.cat(mixed_b, 1), alone_b))
        if shared > ctx.tol:
            return failed("kv_cache.shared", shared, diff=shared)
    return passed("kv_cache.equal", worst, worst=worst, bytes=kvcache.cache_bytes(cache), positions=T)
