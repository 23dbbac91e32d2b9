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
    over the query axis; **warns** when the scores look unscaled or scaled more than 1/sqrt(d_head), when no token
    attends to itself (a masked diagonal), and when a q.k product weights the values with no softmax (a softmax
    written out by hand, rows non-negative and summing to 1, counts as one)"""
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
        return warned("attention.unscaled", value, where=worst.where or "root", ratio=worst.scale_ratio, note=worst.scale_note.text,
                      head_dim=worst.head_dim, limit=UNSCALED_RATIO, calls=calls)
    return passed("attention.stats", value, calls=calls)


def decoded_off(got: torch.Tensor, full: torch.Tensor, label: str) -> tuple[Outcome | None, list[float]]:
    """Per position, how far decoded outputs are from the full forward's (rel_diff); a kv_cache.shape failure instead
    where their shapes differ."""
    if got.shape != full.shape:
        return failed("kv_cache.shape", list(got.shape), split=label, got=list(got.shape), expected=list(full.shape)), []
    return None, [rel_diff(got[:, t], full[:, t]) for t in range(full.shape[1])]


def check_kv_cache(ctx: Context) -> Outcome:
    """Decoding with the block's cache equals the full causal forward at every position, for two chunkings, decoded
    in turns: one sequence a prompt then one token at a time, the other the same prompt length then chunks of 3,
    each with its own cache.

    Catches: with `--causal` and a `decode` method: cached decoding that differs from the full forward; a graph
    growing across steps; caches that share state ([decoding.md](decoding.md))"""
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
            wrong, per_pos = decoded_off(got, full, label)
            if wrong is None and max(per_pos) > ctx.tol:
                ctx.step(f"decoding {label} alone")
                wrong_alone, alone = decoded_off(kvcache.decode_chunks(module, seq.clone(), sizes)[0], full, label)
                ctx.subject.ran(len(sizes))
                if wrong_alone is None and max(alone) <= ctx.tol:
                    return failed("kv_cache.shared", max(per_pos), diff=max(per_pos))
                wrong, per_pos = wrong_alone, alone
            if wrong is not None:
                return wrong
            bad = next((t for t, d in enumerate(per_pos) if d > ctx.tol), None)
            if bad is not None:
                return failed("kv_cache.differs", max(per_pos), split=label, position=bad, diff=per_pos[bad], worst=max(per_pos))
            graphs = [t for t in [got, *kvcache.cache_tensors(cache)] if t.grad_fn is not None]
            if graphs:
                return failed("kv_cache.graph", len(graphs), split=label, tensors=len(graphs))
            worst = max(worst, max(per_pos))
    return passed("kv_cache.equal", worst, worst=worst, bytes=kvcache.cache_bytes(cache), positions=T)
