"""Spec readers: how positions enter attention. On identical tokens whatever differs between positions came from
positions: q rotating channel pair by channel pair (rotary: the angle advanced per position is each pair's frequency),
or an additive bias on the scores (read with q zeroed: ALiBi's slopes, a relative bias's curve and bucket steps)."""

from __future__ import annotations

import math

import torch

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.rope_table import FREQ_TOL, RATIO_TOL, ratio_tol, scaling_reading
from tblock_cli.card.scores import Scores, capture_scores, trace_scores
from tblock_cli.checks.positions import (
    BIAS_MIN,
    LINEAR_FIT,
    SLOPE_FLOOR,
    TOEPLITZ_LIMIT,
    centred_rows,
    line_fit,
    toeplitz_error,
)

ROPE_KEYS = ("rope.theta", "rope.dims", "rope.place", "rope.pairing", "rope.direction", "rope.scaling", "rope.factor", "rope.freqs", "rope.low_freq_wavelen",
             "rope.high_freq_wavelen")
BIAS_KEYS = ("alibi.slopes", "relbias.bidirectional", "relbias.curve", "relbias.steps")
# Positions the rotation is read over: each pair's advance is averaged over 63 steps.
ROPE_SEQ = 64
# A channel of q varies with position where it moves by more than this share of q's largest entry (constant channels
# are exactly constant: 0 in float64).
VARY = 1e-9
# A pairing rotates where each pair's radius and per-position advance are constant to this (relative radius, radians).
# Measured: HF rotary (cos/sin computed in float32, cast to float64) <= 1.1e-6 (llama, cohere, gpt_neox); the other
# pairing of the same q: >= 0.9. Angles rounded to bfloat16 (a block that casts its cos/sin so) stay ~1e-2 under it.
ROTATION_TOL = 0.05
# Positions at the start of the sequence a rotation is read again without, where it is not read from the first: a
# causal convolution of width up to BOUNDARY + 1 before the rotation sees its zero padding there (Mamba's width 4)
BOUNDARY = 4
# theta, relative: it is the ratio of neighbouring frequencies to the power dims/2, so their error grows 32x at 64
# pairs: <= 1e-4 measured; bugs are factors (10000 against 500000 or 1e6).
THETA_TOL = 0.02
# The scaling's factor, relative (measured: exact to the table's float32 rounding).
FACTOR_TOL = 0.02
# q's rotating channels at position 0 (not yet turned) are found among a projection's outputs where their sorted values,
# standardised, match a window of that output's to this (one affine map per head: a scale, a norm over the head; float32
# probes match to ~1e-6; random windows of four values or more miss by far more).
LAYOUT_TOL = 1e-4
# Tokens the additive bias is read over: relative buckets at distances up to 47 each way.
BIAS_SEQ = 48
# The relative-bias curve is shown to this distance each way.
CURVE_SPAN = 16
# Neighbouring distances whose bias differs by more than this (relative to the bias's range) are in different buckets.
STEP_TOL = 1e-6
# An ALiBi slope, relative (float64: exact; the paper's slopes for n heads differ by >= 2^(-8/n) - 1 between heads).
SLOPE_TOL = 0.01


def pairings(n: int) -> dict[str, list[tuple[int, int]]]:
    """The two ways n rotating channels pair up, by their index among them: half-split (i, i + n/2), interleaved
    (2i, 2i + 1)."""
    return {"half": [(i, i + n // 2) for i in range(n // 2)], "interleaved": [(2 * i, 2 * i + 1) for i in range(n // 2)]}


def rotary_reading(q: torch.Tensor) -> dict | None:
    """(B, H, T, E) q on identical tokens: the rotating channels, their pairing and each pair's frequency; None where q
    does not vary with position; {"other": why} where it varies but no pairing of the varying channels rotates. Where
    none rotates from the first token, read again after the first BOUNDARY: a short causal convolution over time before
    the rotation (Primer's on q, k and v, Canon layers') sees its zero padding there."""
    got = _rotary_reading(q[0])
    if got is not None and "other" in got and q.shape[-2] >= BOUNDARY + 8:
        later = _rotary_reading(q[0, :, BOUNDARY:])
        if later is not None and "other" not in later:
            return later
    return got


def _rotary_reading(q: torch.Tensor) -> dict | None:
    """rotary_reading's, of (H, T, E) q from its first position on."""
    moved = (q - q[:, :1]).abs().amax((0, 1)) > VARY * q.abs().max()
    S = torch.nonzero(moved).flatten().tolist()
    if not S:
        return None
    n = len(S)
    if n % 2:
        return {"other": f"{n} channels vary with position: an odd count cannot rotate in pairs"}
    best = None
    for pairing, pairs in pairings(n).items():
        z = torch.complex(q[:, :, [S[a] for a, _ in pairs]], q[:, :, [S[b] for _, b in pairs]])  # (H, T, pairs)
        r = z.abs()
        radius = ((r - r.mean(1, keepdim=True)).abs().amax(1) / r.mean(1).clamp_min(1e-300)).max().item()
        step = torch.angle(z[:, 1:] * z[:, :-1].conj())  # (H, T-1, pairs), each advance in (-pi, pi]
        wobble = (step - step.mean(1, keepdim=True)).abs().max().item()
        err = max(radius, wobble)
        if best is None or err < best[0]:
            best = (err, pairing, step.mean(1))
    err, pairing, signed = best
    omega = signed.abs()
    if err > ROTATION_TOL:
        return {"other": f"{n} channels vary with position but no pairing of them rotates (off by {err:.2g})"}
    spread = ((omega - omega.mean(0)).abs().max() / omega.mean(0).abs().clamp_min(1e-300).max()).item()
    if spread > FREQ_TOL:
        return {"other": f"the heads rotate at different frequencies (spread {spread:.2g})"}
    freqs = sorted(omega.mean(0).tolist(), reverse=True)
    ambiguous = n == 2  # one pair: half-split and interleaved are the same channels
    # the way each pair turns: the lower channel of a pair as the real part (both pairings), x0 cos - x1 sin (Llama's
    # and nearly every family's) advances the angle; nanochat's rotate-half, a sign slipped into one, or positions
    # counted down turn it back
    direction = "forward" if bool((signed > 0).all()) else "backward" if bool((signed < 0).all()) else "mixed"
    return {"dims": n, "pairing": None if ambiguous else pairing, "freqs": freqs, "channels": S, "error": err,
            "direction": direction, "width": q.shape[-1]}


def rotations_apart(q_rot: dict | None, k_rot: dict | None) -> str | None:
    """Why q and k do not rotate together (scores depend on j - i only if both turn alike); None if both or none turn."""
    if q_rot is None and k_rot is None:
        return None
    if k_rot is None:
        return "q rotates with position but k does not: the scores depend on the query's own position"
    if q_rot is None:
        if "other" in k_rot:
            return f"k varies with position and q does not ({k_rot['other']})"
        return "k rotates with position but q does not: the scores depend on the key's own position"
    if "other" in k_rot:
        return f"q rotates, k does not ({k_rot['other']})"
    if k_rot["channels"] != q_rot["channels"]:
        return f"q and k rotate different channels ({len(q_rot['channels'])} of q's, {len(k_rot['channels'])} of k's)"
    if k_rot["direction"] != q_rot["direction"]:
        return (f"q turns {q_rot['direction']} and k {k_rot['direction']} with position: the scores depend on i + j, "
                "not j - i")
    worst = max(abs(a - b) / max(abs(a), 1e-300) for a, b in zip(q_rot["freqs"], k_rot["freqs"]))
    if worst > FREQ_TOL:
        return f"q and k rotate at different frequencies (apart by {worst:.2g}, relative)"
    return None


def layout_pairing(probe: Probe, x: torch.Tensor, call: Scores, rot: dict) -> str | None:
    """The pairing in the channels q's projection writes: q may reach the product permuted (HF's DeepSeek-V3
    de-interleaves q before a rotate-half: interleaved in the weights, half at the product). At position 0 q has not
    turned, so each head's rotating channels are a window of a projection's output up to an affine map (a scale, a norm
    over the head), found by their sorted values; their order there maps each product pair back to the projection's
    channels. None where no window matches in every head read, values tie, or the pairs map to neither layout."""
    modules = dict(probe.module.named_modules())
    names = [n for n in call.sources if n in modules]
    if not names:
        return None
    outs: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_m, _i, out):
            if name not in outs and isinstance(out, torch.Tensor) and out.ndim >= 2:
                outs[name] = out.detach()
        return hook

    handles = [modules[n].register_forward_hook(keep(n)) for n in names]
    try:
        probe.forward(x)
    except Exception:  # noqa: BLE001 - a block that refuses a second call: the layout is not read
        return None
    finally:
        for h in handles:
            h.remove()
    rows = [o.reshape(-1, o.shape[-1])[0].double() for o in outs.values()]  # position 0 of the first sequence
    S, n = rot["channels"], rot["dims"]
    layouts = {k: set(v) for k, v in pairings(n).items()}
    z = lambda t: (t - t.mean(-1, keepdim=True)) / t.std(-1, keepdim=True).clamp_min(1e-300)
    found = set()
    for v in call.q[0, :4, 0, S].detach().double():  # up to four heads, each (n,)
        sv, order_v = torch.sort(v)
        if not bool((sv.diff() > 0).all()):  # equal values: their places cannot be told apart
            return None
        at = None
        for u in rows:
            if u.numel() < n:
                continue
            su, order_u = torch.sort(u.unfold(0, n, 1), dim=-1)  # every window of n channels, sorted
            err = (z(su) - z(sv)).abs().amax(-1)
            best = int(err.argmin())
            if float(err[best]) <= LAYOUT_TOL:
                at = torch.empty(n, dtype=torch.long, device=order_u.device)
                at[order_v] = order_u[best]  # each rotating channel's place in the projection's window
                break
        if at is None:
            return None
        mapped = {tuple(sorted((int(at[a]), int(at[b])))) for a, b in layouts[rot["pairing"]]}
        found.add(next((k for k, pairs in layouts.items() if mapped == pairs), None))
    return found.pop() if len(found) == 1 else None


def place_entry(rot: dict) -> Entry:
    """rope.place: where the rotating channels sit among the head's at the q.k product, where only some rotate."""
    S, n, width = rot["channels"], rot["dims"], rot.get("width", rot["dims"])
    if n >= width:
        return skipped("rope.place", "every channel of the head rotates")
    place = "first" if S == list(range(n)) else "last" if S == list(range(width - n, width)) else "other"
    return Entry("rope.place", place, f"the rotating channels at the product: {S[0]}..{S[-1]} of {width}", judged=False)


def rope_entries(rot: dict, tol: float = RATIO_TOL) -> list[Entry]:
    how = (f"q on identical tokens: {rot['dims']} channels rotate (each pair's radius and advance per position constant "
           f"to {rot['error']:.1g})")
    layout = rot.get("layout")
    if not rot["pairing"]:
        pairing = skipped("rope.pairing", "one rotating pair: half-split and interleaved coincide")
    elif layout is None:
        pairing = skipped("rope.pairing", f"q rotates in {rot['pairing']} pairs at the product; its channels were not "
                                          "found among its projection's outputs (the weights' layout)")
    else:
        moved = "" if layout == rot["pairing"] else f" ({rot['pairing']} at the product: q's channels are permuted)"
        pairing = Entry("rope.pairing", layout, "the pairing under which q rotates, in the channels its projection "
                                                f"writes{moved}", judged=False)
    out = [Entry("pos.kind", "rotary", how),
           Entry("rope.dims", rot["dims"], f"channels of q that vary with position: {rot['channels'][:4]}..."),
           place_entry(rot),
           pairing,
           Entry("rope.direction", rot["direction"], "the sign of every pair's mean advance per position, the lower "
                                                     "channel of a pair as the real part (forward: Llama's)"),
           Entry("rope.freqs", tuple(round(f, 12) for f in rot["freqs"]),
                 "the mean angle each pair advances per position, radians", FREQ_TOL)]
    sc = scaling_reading(rot["freqs"], rot["dims"], tol)
    if "why" in sc:
        return out + [skipped(k, sc["why"]) for k in ("rope.theta", "rope.scaling", "rope.factor")]
    out.append(Entry("rope.theta", round(sc["theta"], 6), "theta^(-2i/dims) fitted on the fastest pairs' geometric run",
                     THETA_TOL))
    out.append(Entry("rope.scaling", sc["scaling"], "the measured table against theta's plain table"))
    out.append(Entry("rope.factor", round(sc["factor"], 6), "theta's plain frequency over the slowest pair's", FACTOR_TOL)
               if sc["factor"] is not None else skipped("rope.factor", "no single factor scales this table"))
    band = sc.get("wavelens")
    for key, i, side in (("rope.low_freq_wavelen", 0, "the slow"), ("rope.high_freq_wavelen", 1, "the fast")):
        if band is not None:
            out.append(Entry(key, round(band[i], 3), f"where llama-3's band meets {side} pairs: its ramp, linear in the "
                                                     f"plain frequency over the band's pairs, at {i}", FACTOR_TOL))
        else:
            out.append(skipped(key, "no llama-3 band of two pairs or more (the band's ends are read off its ramp)"
                               if sc.get("scaling") in ("llama3", "yarn") else "no llama-3 scaling"))
    return out


def bias_by_distance(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H, T, T) scores with q zeroed: per head the bias against j - i = -(T-1)..T-1 (each row centred on its own
    entry, averaged down each diagonal), where it is seen (a causal block sees j <= i only), and the centred rows."""
    T = z.shape[-1]
    c, live = centred_rows(z[:1])
    c, live = c[0], live[0]  # (H, T, T)
    f, seen = [], []
    for o in range(-(T - 1), T):  # diagonal o: j - i = o
        d, m = c.diagonal(o, -2, -1), live.diagonal(o, -2, -1)
        n = m.sum(-1)
        f.append((d * m).sum(-1) / n.clamp_min(1))
        seen.append(bool((n > 0).all()))
    return torch.stack(f, -1), torch.tensor(seen), c


def bias_entries(probe: Probe, x: torch.Tensor, call: Scores) -> list[Entry]:
    """The scores with q zeroed are the bias (and the mask): none, ALiBi (linear in distance), a relative bias (a
    function of j - i) or another additive bias."""
    if call.ordinal < 0:
        z = call.logits - call.product() / math.sqrt(call.q.shape[-1])
    else:
        got = [c for c in capture_scores(probe, x, frozenset([call.ordinal]), 0.0) if c.ordinal == call.ordinal]
        if not got:
            return [skipped("pos.kind", "the q.k product was not found again in a second forward")]
        z = got[0].logits
    f, seen, c = bias_by_distance(z)
    T = z.shape[-1]
    if not bool(seen.any()):
        return [skipped("pos.kind", "each query's own key is masked: the bias cannot be read against it")]
    span = (f[:, seen].amax(-1) - f[:, seen].amin(-1)).max().item()
    if span <= BIAS_MIN:
        # not judged against a reference: an HF layer reads none where its model adds positions to the embeddings,
        # which a block under test may add itself (absolute)
        return [Entry("pos.kind", "none", f"q constant over positions on identical tokens; the scores with q zeroed vary "
                                          f"{span:.2g} along a row", judged=False)]
    if toeplitz_error(z) > TOEPLITZ_LIMIT[torch.float32]:
        return [Entry("pos.kind", "bias", "an additive bias on the scores that is not a function of j - i")]
    past = f[:, : T].flip(-1)  # j - i = 0, -1, ..., -(T-1): the keys before, which every block sees
    fits = [line_fit(row) for row in past]
    rng = (past.amax(-1) - past.amin(-1)).clamp_min(1e-30)
    if all(res <= LINEAR_FIT * r for (_, res), r in zip(fits, rng.tolist())) and min(m for m, _ in fits) > SLOPE_FLOOR:
        return [Entry("pos.kind", "alibi", "the scores with q zeroed fall linearly with distance in every head"),
                Entry("alibi.slopes", tuple(round(m, 9) for m, _ in fits), "per head, the bias's fall per token of "
                                                                           "distance to earlier keys", SLOPE_TOL)]
    causal = not bool(seen[T:].any())
    lo = T - 1 - CURVE_SPAN
    curve = f[0, lo : T if causal else T + CURVE_SPAN]
    steps = _steps(f[0], seen, span, T)
    out = [Entry("pos.kind", "relative_bias", "the scores with q zeroed: a function of j - i, not linear"),
           Entry("relbias.curve", tuple(round(v, 9) for v in curve.tolist()),
                 f"head 0's bias at j - i = -{CURVE_SPAN}..{0 if causal else CURVE_SPAN} (0 at the query itself)",
                 judged=False),
           Entry("relbias.steps", steps, f"the distances j - i where head 0's bias changes value (bucket boundaries), "
                                         f"within {T - 1} tokens")]
    if causal:
        out.append(skipped("relbias.bidirectional", "causal: the keys after each query are masked, so the bias there "
                                                    "is never applied (relbias.steps shows the buckets of the keys before)"))
    else:
        after = [o for o in steps if o > 0]
        out.append(Entry("relbias.bidirectional", bool(after),
                         f"head 0's bias changes with distance among the keys after the query at {len(after)} "
                         f"distances (keys before: {len(steps) - len(after)})"))
    return out


def _steps(f: torch.Tensor, seen: torch.Tensor, span: float, T: int) -> tuple[int, ...]:
    """j - i values where the bias differs from the one at the next distance toward the query (a new bucket)."""
    out = []
    for idx in range(len(f)):
        o = idx - (T - 1)
        nxt = idx + 1 if o < 0 else idx - 1  # one step nearer the query
        if o == 0 or not seen[idx] or not seen[nxt]:
            continue
        if abs(f[idx] - f[nxt]).item() > STEP_TOL * max(span, 1e-30):
            out.append(o)
    return tuple(out)


def read(probe: Probe) -> list[Entry]:
    for T in dict.fromkeys((ROPE_SEQ, max(probe.cfg.seq, 8))):  # a block with a shorter maximum: read at its own length
        try:
            x = probe.identical(T)
            calls, tr = trace_scores(probe, x)
            break
        except Exception as e:  # noqa: BLE001 - the block refuses this length
            why = f"the block refused {T} tokens: {type(e).__name__}"
    else:
        return [skipped("pos.kind", why)]
    calls = [c for c in calls if c.square and c.logits.shape[-1] == T]
    if not calls:
        return [skipped("pos.kind", "no self-attention call whose q and k could be read")]
    call = calls[0]
    absent = {k: "no rotary" for k in ROPE_KEYS} | {k: "no ALiBi" for k in BIAS_KEYS[:1]} | \
             {k: "no relative bias" for k in BIAS_KEYS[1:]}
    # the projections reaching q (any projection where the trace lost them: on identical tokens attention outputs
    # are equal rows too, so only positions added to the stream make a projection's rows differ)
    read_by_q = call.sources or tuple(tr.attn.uniform_in)
    if not all(tr.attn.uniform_in.get(n, True) for n in read_by_q):
        return [Entry("pos.kind", "absolute", "the projections reaching q read rows that differ on identical tokens: "
                                              "positions entered before them")] + [skipped(k, "absolute positions")
                                                                                   for k in absent]
    # a q or k projection initialised to zero (muP zeroes the query's) shows no rotation: the other one is read
    zero_q, zero_k = (not bool(t.abs().max() > 0) for t in (call.q, call.k))
    rot = rotary_reading(call.k if zero_q else call.q)
    if rot is not None and "other" in rot:
        return [Entry("pos.kind", "other", rot["other"])] + [skipped(k, rot["other"]) for k in ROPE_KEYS]
    apart = None if zero_q or zero_k else rotations_apart(rot, rotary_reading(call.k))
    if apart is not None:
        return [Entry("pos.kind", "other", apart)] + [skipped(k, apart) for k in ROPE_KEYS]
    if rot is not None:
        if rot["pairing"] and not zero_q:
            rot["layout"] = layout_pairing(probe, x, call, rot)
        out = rope_entries(rot, ratio_tol(probe.cfg.dtype, rot["error"]))
    else:
        Tb = min(BIAS_SEQ, T)
        xb = probe.identical(Tb)
        probe.forward(xb)  # a block that caches per length settles first: the zeroed-q forward makes the same calls
        bias_calls = [c for c in capture_scores(probe, xb) if c.square and c.logits.shape[-1] == Tb]
        out = bias_entries(probe, xb, bias_calls[0]) if bias_calls else [skipped("pos.kind", "no self-attention call "
                                                                                           "at the bias's length")]
    have = {e.key for e in out}
    return out + [skipped(k, why) for k, why in absent.items() if k not in have]
