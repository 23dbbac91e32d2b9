"""q and k rotated at the same positions, for `relative`: with k's projection given q's weights, k enters the q.k
product as q does, every rotating pair at the same angle at every position. A key rotated at positions 1..T against
queries at 0..T-1 keeps the scores a function of i - j (the Toeplitz probe passes) and moves every one of them by a
position: the block attends one token off."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.anatomy.attention import rows_spread
from tblock_cli.checks import positions
from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import parameters_swapped

# Tokens of the probe: enough positions for the slowest pairs of a 16-channel head to advance.
ALIGN_SEQ = 16
# Largest phase between q's and k's rotating pairs (radians) still "aligned": both rotate by the same table, so equal
# positions give equal angles to rounding (<= 1e-12 measured in float64 from float32 tables); one position apart moves
# a d_head-64 block's fastest pair by 1 rad and its slowest by 1.2e-4.
PHASE_TOL = 1e-6
# Largest relative difference between the values (then the outputs) of identical tokens at two positions of the
# probe's middle half: float64 copies of correct blocks give 0 (v = x W_v is the same row for the same token, and a
# relative scheme's attention to itself returns it); a rotary embedding applied to v moves its fastest pairs by a
# radian per position.
VALUES_TOL = 1e-6
# q and k scaled so each query attends to itself: q.R(d)q falls short of |q|^2 by a share of it at d != 0, and the
# scores grow by SHARPEN^2 (float64: no overflow).
SHARPEN = 100.0
# The gate on the shared identical-token probe, in the run's dtype: values of identical tokens computed alike are equal
# (0); rotated ones differ by O(1). Half precision's rounding stays far below.
VALUES_GATE = 1e-3
# A pair's magnitude below this share of the largest carries no phase worth reading.
LIVE = 1e-6


def check_relative(ctx: Context) -> Outcome:
    """With every token identical, scores of a relative (or no) position scheme depend on i - j only, and q and k are
    rotated at the same positions.

    Catches: with every token identical, attention scores (each row taken relative to its own diagonal) that are not
    a function of i - j: a rotary cos/sin layout that does not match its rotation, rotary angles computed in half
    precision (probed at 320 tokens in fp16/bf16); blocks whose positions enter before the q/k projections
    (absolute) are skipped; scores that are a function of i - j from the middle of the sequence on pass (a
    convolution's zero padding reaching the first positions: Primer), and so do scores that are a function of the 2D
    offset on a patch grid after up to 5 special tokens (BEiT's bias table, EVA-02's rotary); scores that are a
    function of i - j only at the
    block's init, not once its constant gains and biases are redrawn, are a **warning** (a q/k norm after the rotary
    embedding, a bias added to rotated queries: trained, they break relative positions); q and k rotated at different
    positions, the scores still a function of i - j, each shifted (k rotated from position 1): with k's projection
    given q's weights (a float64 copy, separate q and k projections, up to 50M parameters), k's rotating pairs stand at
    other angles than q's; values that differ between positions while the tokens are identical and the scores are
    positioned (a rotary embedding applied to v too)"""
    outcome = positions.check_relative(ctx)
    if outcome.kind not in ("relative.toeplitz", "relative.gains_inside") or not outcome.facts.get("positioned"):
        return outcome  # broken already, or scores flat along every row: no rotation to compare
    moved = values_moved(ctx)
    if moved is not None and moved["moved"] > VALUES_TOL:  # values positioned and never rotated back
        return failed("relative.values_positioned", moved["moved"], **{**outcome.facts, **moved, "limit": VALUES_TOL})
    off = qk_offset(ctx)
    if off is None or off["phase"] <= PHASE_TOL:
        return outcome
    return failed("relative.qk_offset", off["offset"] if off["offset"] is not None else off["phase"], **{**outcome.facts, **off})


def values_moved(ctx: Context) -> dict | None:
    """With every token identical (a float64 copy, ALIGN_SEQ tokens): where the values entering an attention call
    (sdpa's v, as the card captures it) differ between the positions of the probe's middle half, whether the block's
    output still does once each query attends to itself alone (k's projection given q's weights, both scaled by
    SHARPEN: q.R(d)q is largest at d = 0). A relative scheme that rotates the values rotates the weighted sum back
    (VO-RoPE): then every row is the same token's again. {"moved": the output rows' largest relative difference,
    "values": the values', "where"}; None where nothing moves or it cannot be read (no sdpa values, q and k not two
    projections of one shape)."""
    from tblock_cli.card.probe import float64_probe
    from tblock_cli.card.scores import capture_scores
    from tblock_cli.checks.training import too_large

    if too_large(ctx) is not None:
        return None
    try:  # the identical-token probe relative shares: where no call's values move, nothing more is run
        seen = positions.identical_scores(ctx).calls
    except Exception as e:  # noqa: BLE001 - a block the tracer cannot follow: no evidence
        if is_out_of_memory(e):
            raise
        return None
    if not any(got is not None and (got.values_spread or 0.0) > VALUES_GATE for _, got in seen):
        return None
    try:
        probe = float64_probe(ctx.subject, ctx.cfg, ctx.device)
        x = probe.identical(ALIGN_SEQ)
        calls = [c for c in capture_scores(probe, x) if c.v is not None and c.v.ndim == 4 and c.v.shape[-2] == ALIGN_SEQ
                 and len(c.sources) == 1 and len(c.k_sources) == 1 and c.sources != c.k_sources]
        moving = [(c, rows_spread(c.v[0])) for c in calls]
        moving = [(c, m) for c, m in moving if m > VALUES_TOL]
        if not moving:
            return None
        call, values = moving[0]
        qm, km = _qk_linears(probe, call) or (None, None)
        if qm is None or km.weight.shape != qm.weight.shape:
            return None
        new = {(qm, "weight"): nn.Parameter(qm.weight.detach() * SHARPEN),
               (km, "weight"): nn.Parameter(qm.weight.detach() * SHARPEN)}
        if qm.bias is not None:
            new[(qm, "bias")] = nn.Parameter(qm.bias.detach() * SHARPEN)
            new[(km, "bias")] = nn.Parameter(qm.bias.detach() * SHARPEN)
        with parameters_swapped(new):
            out = probe.forward(x)
    except Exception as e:  # noqa: BLE001 - a block that refuses the probe: nothing read
        if is_out_of_memory(e):
            raise
        return None
    if not isinstance(out, torch.Tensor) or out.ndim != 3 or out.shape[1] != ALIGN_SEQ:
        return None
    return {"moved": rows_spread(out[0]), "values": values, "where": call.where}


def _qk_linears(probe, call) -> tuple[nn.Linear, nn.Linear] | None:
    """The query and key projections of a captured call where they are two nn.Linear of one input width, with a bias
    on both sides or on neither (q and k from one fused projection, or from anything else: None)."""
    if len(call.sources) != 1 or len(call.k_sources) != 1 or call.sources == call.k_sources:
        return None
    mods = dict(probe.module.named_modules())
    qm, km = mods.get(call.sources[0]), mods.get(call.k_sources[0])
    if not (isinstance(qm, nn.Linear) and isinstance(km, nn.Linear)) or (qm.bias is None) != (km.bias is None) \
            or km.weight.shape[1:] != qm.weight.shape[1:]:
        return None
    return qm, km


def qk_rows(weight: torch.Tensor, heads: int, kv_heads: int, interleaved: bool) -> torch.Tensor:
    """q's projection rows laid out as k's (head-major rows, as a projection split by `view(B, T, H, E)` lays them):
    key head j takes query head j * group's rows where each key head serves a run of query heads (`repeat_kv`,
    sdpa's enable_gqa), query head j's where the key heads are tiled (`repeat(1, group, 1, 1)`)."""
    if heads == kv_heads:
        return weight.detach().clone()
    rows = weight.detach().reshape(heads, weight.shape[0] // heads, *weight.shape[1:])
    picked = rows[:: heads // kv_heads] if interleaved else rows[:kv_heads]
    return picked.reshape(-1, *weight.shape[1:]).clone()


def qk_offset(ctx: Context) -> dict | None:
    """How far k's rotation is from q's, read on a float64 copy: {"phase": the largest angle between a q pair and the
    k pair its key head shares with it, "offset": k's positions minus q's (read on the slowest pair), "where"}; None
    where it cannot be read (no rotation; q and k from one fused projection, or from projections of other shapes;
    a bias on one side only)."""
    from tblock_cli.card.positions import rotary_reading
    from tblock_cli.card.probe import float64_probe
    from tblock_cli.card.scores import capture_scores
    from tblock_cli.checks.training import too_large

    if too_large(ctx) is not None:  # a float64 copy and two or three forwards: left to blocks of training-check size
        return None
    try:
        probe = float64_probe(ctx.subject, ctx.cfg, ctx.device)
        x = probe.identical(ALIGN_SEQ)
        calls = [c for c in capture_scores(probe, x) if c.square and c.logits.shape[-1] == ALIGN_SEQ]
        if not calls:
            return None
        call = calls[0]
        rot = rotary_reading(call.q)
        qm, km = _qk_linears(probe, call) or (None, None)
        if rot is None or "other" in rot or qm is None:
            return None
        H, E = call.q.shape[1], call.q.shape[-1]
        if qm.weight.shape[0] != H * E or km.weight.shape[0] % E or H % (km.weight.shape[0] // E):
            return None
        kv = km.weight.shape[0] // E
        best = None
        for interleaved in (True, False) if kv != H else (True,):
            new = {(km, "weight"): nn.Parameter(qk_rows(qm.weight, H, kv, interleaved))}
            if qm.bias is not None:
                new[(km, "bias")] = nn.Parameter(qk_rows(qm.bias, H, kv, interleaved))
            with parameters_swapped(new):
                again = [c for c in capture_scores(probe, x) if c.ordinal == call.ordinal]
            got = again and _apart(again[0], rot, kv, interleaved)
            if got and (best is None or got["phase"] < best["phase"]):
                best = got
            if best is not None and best["phase"] <= PHASE_TOL:
                break
    except Exception as e:  # noqa: BLE001 - a block that refuses the probe: nothing read
        if is_out_of_memory(e):
            raise
        return None
    return None if best is None else {**best, "where": call.where, "q_proj": call.sources[0], "k_proj": call.k_sources[0]}


def _apart(call, rot: dict, kv: int, interleaved: bool) -> dict | None:
    """The angle between each rotating pair of q and of the k that now shares its weights, over every position."""
    q, k = call.q[0], call.k[0]  # (H, T, E), (kv or H, T, E)
    H = q.shape[0]
    group = H // kv
    heads = torch.arange(kv) * group if interleaved else torch.arange(kv)  # the query heads whose rows k took
    q = q[heads]
    k = k if k.shape[0] == kv else k[heads]
    S = rot["channels"]
    first, second = (S[: len(S) // 2], S[len(S) // 2:]) if rot["pairing"] == "half" else (S[0::2], S[1::2])
    zq, zk = torch.complex(q[..., first], q[..., second]), torch.complex(k[..., first], k[..., second])
    live = (zq.abs() > LIVE * zq.abs().max()) & (zk.abs() > LIVE * zk.abs().max())
    if not bool(live.any()):
        return None
    apart = torch.angle(zq * zk.conj())  # (heads, T, pairs)
    omega = torch.angle(zq[:, 1:] * zq[:, :-1].conj()).mean((0, 1)).abs()  # each pair's advance per position
    slow = int(torch.where(omega > 1e-9, omega, torch.full_like(omega, torch.inf)).argmin())
    seen = live[..., slow]
    offset = -(apart[..., slow][seen].median() / omega[slow]).item() if bool(seen.any()) else None
    return {"phase": apart[live].abs().max().item(), "offset": offset}
