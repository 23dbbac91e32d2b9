"""The block's own claims fitted to what its card could read: a rotating fraction turned into rope.dims once the head's
width is known, a kept window judged within one token and only where the probe can see it, a config's routing held
only against a mixture layer and its FFN width only against a dense one (an expert's width is another); and claims
the card judges in its own terms: a scaling's attention factor as a score scale, LongRoPE's factors as a frequency
table, a dynamic scaling's theta only within its original length, RoPE's direction wherever a block says it rotates,
T5's bucket count as the distances where the bias changes, a family's softmax router and shared expert gate,
and what a family computes with no field saying it."""

from __future__ import annotations

import dataclasses
import math

import torch

from tblock_cli.card.entries import Card, Claim
from tblock_cli.card.own import FRACTION
from tblock_cli.card.own_names import (
    BACKWARD_ROTATION,
    DYNAMIC,
    FAMILY,
    FAMILY_IMPLIED,
    LONGROPE,
    MSCALE_FAMILIES,
    NGROUP,
    RATIO,
    RELBUCKETS,
    RELMAX,
    RELONEWAY,
    RENORM_FAMILIES,
    RENORM_OFF,
    SIGMOID_SHARED_GATES,
    SOFTMAX_GAIN,
    TOPKGROUP,
    TOPKMETHOD,
    YARN_GAIN,
)
from tblock_cli.card.positions import BIAS_SEQ, ROPE_SEQ

PSEUDO = (FRACTION, RATIO, YARN_GAIN, LONGROPE, DYNAMIC, RELBUCKETS, RELMAX, RELONEWAY, FAMILY, NGROUP, TOPKGROUP,
          TOPKMETHOD, RENORM_OFF, SOFTMAX_GAIN)


def needed(claims: tuple[Claim, ...]) -> tuple[str, ...]:
    """The card keys to read for the block's own claims: theirs, and those `fitted` decides by."""
    keys = tuple(c.key for c in claims if c.key not in PSEUDO)
    keys += ("rope.freqs", "rope.dims") if any(c.key == LONGROPE for c in claims) else ()
    if any(c.key.startswith("moe.") or c.key in ("ffn.hidden", RATIO) for c in claims):
        keys += ("moe.experts", "ffn.act")
    keys += ("ffn.gated", "ffn.hidden") if any(c.key == RATIO for c in claims) else ()
    keys += ("attn.scale",) if any(c.key in (YARN_GAIN, SOFTMAX_GAIN) for c in claims) else ()
    keys += ("rope.direction",) if _rotary_claim(claims) is not None and _family(claims) is not None else ()
    keys += ("relbias.steps", "attn.causal") if any(c.key == RELBUCKETS for c in claims) else ()
    keys += ("moe.groups",) if any(c.key == NGROUP for c in claims) else ()
    keys += ("moe.renorm",) if any(c.key == RENORM_OFF for c in claims) else ()
    f = _family(claims)
    implied = tuple(FAMILY_IMPLIED.get(f.value, {})) if f is not None and isinstance(f.value, str) else ()
    keys += implied + (("moe.experts",) if any(k.startswith("moe.") for k in implied) else ())
    keys += ("moe.shared_gate",) if f is not None and f.value in SIGMOID_SHARED_GATES else ()
    return keys + (("attn.head_dim", "rope.dims") if any(c.key in (FRACTION, YARN_GAIN, SOFTMAX_GAIN) for c in claims)
                   else ())


def fitted(claims: tuple[Claim, ...], card: Card, seq: int, d_model: int | None = None) -> tuple[Claim, ...]:
    """The block's own claims as `card` can judge them (see the module's docstring); `seq` is the window probe's length.
    An FFN width is held only where the card fitted the FFN's curve: a hybrid layer's first `down` projection may be
    a Mamba mixer's (hf:jamba's and falcon_h1's read 1024 and 128 beside an intermediate_size of 2048)."""
    claims = with_dynamic(with_longrope(claims))
    claims = with_fraction(claims, card.value("attn.head_dim"))
    claims = with_yarn_gain(claims, card.value("attn.head_dim"), card.value("rope.dims"))
    claims = with_softmax_gain(claims, card.value("attn.head_dim"))
    claims = with_window(with_ratio(claims, card.value("ffn.gated"), d_model), seq)
    claims = with_renorm_off(with_shared_gate(with_implied(claims)))
    claims = with_groups(with_buckets(with_direction(claims), card.value("attn.causal")))
    experts, act = card.value("moe.experts"), card.value("ffn.act")
    dense_ffn = not experts and act not in (None, "other")
    return tuple(c for c in claims if not (c.key.startswith("moe.") and not experts)
                 and not (c.key == "ffn.hidden" and not dense_ffn))


def with_fraction(claims: tuple[Claim, ...], head_dim) -> tuple[Claim, ...]:
    """The rotating fraction of a head (partial_rotary_factor, rotary_pct) as a rope.dims claim, where the card read
    the head's width and no other claim names rope.dims; dropped otherwise."""
    out = tuple(c for c in claims if c.key != FRACTION)
    fraction = next((c for c in claims if c.key == FRACTION), None)
    if fraction is None or not head_dim or any(c.key == "rope.dims" for c in out):
        return out
    return out + (Claim("rope.dims", float(int(fraction.value * head_dim)), fraction.source),)


def with_longrope(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """LongRoPE's table as a rope.freqs claim: pair i turns at theta^(-2i/dims) / short_factor[i] (dims twice the
    factors' count), with the claimed theta, where the original length holds the card's probe; the theta claim itself
    goes (the factors bend the table away from theta's). Dropped where no theta is claimed or the length is unknown or
    shorter than the probe (the long factors, or either, would apply)."""
    lr = next((c for c in claims if c.key == LONGROPE), None)
    if lr is None:
        return claims
    out = tuple(c for c in claims if c.key not in (LONGROPE, "rope.theta"))
    theta = next((c.value for c in claims if c.key == "rope.theta"), None)
    short, _long, orig = lr.value
    if not isinstance(theta, (int, float)) or not orig or orig < ROPE_SEQ or any(c.key == "rope.freqs" for c in out):
        return out
    dims = 2 * len(short)
    freqs = sorted((theta ** (-2 * i / dims) / f for i, f in enumerate(short)), reverse=True)
    return out + (Claim("rope.freqs", tuple(freqs), lr.source + f" (LongRoPE's short factors over theta {theta:g})",
                        tier=lr.tier),)


def with_dynamic(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """A dynamic NTK scaling keeps theta's table up to its original length and raises the base past it: the theta
    claim stands only where that length is known and holds the card's probe."""
    dyn = next((c for c in claims if c.key == DYNAMIC), None)
    if dyn is None:
        return claims
    out = tuple(c for c in claims if c.key != DYNAMIC)
    return out if dyn.value and dyn.value >= ROPE_SEQ else tuple(c for c in out if c.key != "rope.theta")


def with_yarn_gain(claims: tuple[Claim, ...], head_dim, rope_dims) -> tuple[Claim, ...]:
    """YaRN's attention factor m as an attn.scale claim: m on q and on k puts m^2 on every score, 1/sqrt(X) with
    X = head_dim / m^4. Only where every channel of the head rotates (HF puts m on the rotary table: a partial rotation
    scales some channels alone, no single scale) and no other claim names attn.scale; dropped otherwise."""
    out = tuple(c for c in claims if c.key != YARN_GAIN)
    gain = next((c for c in claims if c.key == YARN_GAIN), None)
    if gain is None or not head_dim or rope_dims != head_dim or any(c.key == "attn.scale" for c in out):
        return out
    return out + (Claim("attn.scale", float(head_dim) / gain.value ** 4, gain.source + " (the scaling's attention "
                        f"factor {gain.value:.4g} on q and k)"),)


def with_softmax_gain(claims: tuple[Claim, ...], head_dim) -> tuple[Claim, ...]:
    """DeepSeek's YaRN softmax gain g (mscale(factor, mscale_all_dim)^2) as an attn.scale claim: the score scale
    g / sqrt(head_dim), X = head_dim / g^2, with the head's q.k width the card reads (MLA's nope + rope channels),
    where the config names a family whose code applies it (MSCALE_FAMILIES) and no argument or config names attn.scale
    itself; it replaces a module's own `scaling` attribute (a port that
    keeps qk_head_dim^-0.5 computes what it keeps, and not what its config says). Dropped otherwise."""
    out = tuple(c for c in claims if c.key != SOFTMAX_GAIN)
    gain, family = next((c for c in claims if c.key == SOFTMAX_GAIN), None), _family(claims)
    if gain is None or not head_dim or any(c.key == "attn.scale" and c.tier != "kept" for c in out) or \
            family is None or family.value not in MSCALE_FAMILIES:
        return out
    out = tuple(c for c in out if c.key != "attn.scale")
    return out + (Claim("attn.scale", float(head_dim) / gain.value ** 2, gain.source + " (DeepSeek's YaRN gain "
                        f"{gain.value:.4g} on the softmax scale, from its mscale_all_dim)", tier=gain.tier),)


def _rotary_claim(claims: tuple[Claim, ...]) -> Claim | None:
    """The first claim that says the block rotates q and k (a rotary base, width, pairing or scaling, or pos.kind
    rotary), or None."""
    return next((c for c in claims if (c.key.startswith("rope.") or c.key == FRACTION) and c.key != "rope.direction"
                 or c.key == "pos.kind" and c.value == "rotary"), None)


def _family(claims: tuple[Claim, ...]) -> Claim | None:
    return next((c for c in claims if c.key == FAMILY), None)


def with_direction(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """A block whose config names a family (transformers' `model_type`: a port of that family's checkpoints) and that
    says it rotates q and k says which way: the family's checkpoints turn pair (x0, x1) by x0 cos - x1 sin,
    x1 cos + x0 sin (the lower channel the real part, in either pairing), the angle growing with the position, but for
    the families of BACKWARD_ROTATION, trained with each pair turned the other way. A rotation the other way computes
    relative scores too, so a block trained from scratch may take either (nanochat's and modded-nanogpt's own code
    turns backward): without a family nothing is claimed. The family claim itself goes."""
    family = _family(claims)
    out = tuple(c for c in claims if c.key != FAMILY)
    said = _rotary_claim(out)
    if family is None or said is None or any(c.key == "rope.direction" for c in out):
        return out
    way = "backward" if family.value in BACKWARD_ROTATION else "forward"
    return out + (Claim("rope.direction", way, family.source + f" ({family.value!r}: its checkpoints turn each pair "
                        f"{way})", tier=family.tier),)


def t5_bucket(o: int, bidirectional: bool, buckets: int, max_distance: int) -> int:
    """The bucket of relative position o = j - i, as T5's _relative_position_bucket computes it (its float32 log)."""
    out = 0
    if bidirectional:
        buckets //= 2
        out += buckets if o > 0 else 0
        n = abs(o)
    else:
        n = -min(o, 0)
    exact = buckets // 2
    if n < exact:
        return out + n
    large = exact + int((torch.log(torch.tensor(n, dtype=torch.float32) / exact) / math.log(max_distance / exact)
                         * (buckets - exact)).item())
    return out + min(large, buckets - 1)


def with_buckets(claims: tuple[Claim, ...], causal) -> tuple[Claim, ...]:
    """T5's bucket count (with its max_distance, 128 by default, and whether the buckets look one way) as the distances
    at which the bias changes value within the card's probe (relbias.steps): where a bucket differs from the one a
    step nearer the query. Only the distances the card sees (a causal block's earlier keys); dropped where the
    direction is not said."""
    said = {c.key: c for c in claims}
    out = tuple(c for c in claims if c.key not in (RELBUCKETS, RELMAX, RELONEWAY))
    nb, one_way = said.get(RELBUCKETS), said.get(RELONEWAY)
    if nb is None or one_way is None or nb.value < 2 or any(c.key == "relbias.steps" for c in out):
        return out
    buckets, top = int(nb.value), int(said[RELMAX].value) if RELMAX in said else 128
    bucket = lambda o: t5_bucket(o, not one_way.value, buckets, top)
    steps = tuple(o for o in range(-(BIAS_SEQ - 1), BIAS_SEQ) if o != 0 and (o < 0 or causal is not True)
                  and bucket(o) != bucket(o + 1 if o < 0 else o - 1))
    return out + (Claim("relbias.steps", steps, nb.source + f" (T5's buckets: {buckets}, to {top}, "
                        f"{'one way' if one_way.value else 'both ways'})", tier=nb.tier),)


def with_implied(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """What a family computes in every layer with no field saying it (FAMILY_IMPLIED: Qwen3's per-head q/k norms,
    Gemma's (1 + w) norms, Mixtral's softmax router, ...), claimed by its model_type for each key no argument, config or attribute claims; over
    what a class name says (a Llama port's config outranks the nn.LayerNorm it was built with)."""
    family = _family(claims)
    implied = FAMILY_IMPLIED.get(family.value, {}) if family is not None and isinstance(family.value, str) else {}
    said = {c.key for c in claims if c.tier != "named"}
    implied = {k: v for k, v in implied.items() if k not in said}
    return tuple(c for c in claims if c.key not in implied) + tuple(
        Claim(key, value, family.source + f" ({family.value!r} computes it in every layer)", tier=family.tier)
        for key, value in implied.items())


def with_shared_gate(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """A family whose transformers code gates its shared expert by a sigmoid (SIGMOID_SHARED_GATES) claims
    moe.shared_gate sigmoid beside a claimed shared expert, where nothing else claims the gate."""
    family = _family(claims)
    if family is None or family.value not in SIGMOID_SHARED_GATES or any(c.key == "moe.shared_gate" for c in claims) \
            or not any(c.key == "moe.shared" and c.value is True for c in claims):
        return claims
    return claims + (Claim("moe.shared_gate", "sigmoid", family.source + f" ({family.value!r} gates its shared expert "
                           "by a sigmoid of a one-output linear)", tier=family.tier),)


def with_renorm_off(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """`norm_topk_prob=False` as a moe.renorm false claim, where the config names a family whose transformers code
    reads the switch (Qwen2-MoE's, OLMoE's: the chosen experts' softmax weights left as they are, not renormalised as
    Mixtral's are) and nothing else claims moe.renorm; dropped otherwise."""
    off = next((c for c in claims if c.key == RENORM_OFF), None)
    out = tuple(c for c in claims if c.key != RENORM_OFF)
    family = _family(claims)
    if off is None or family is None or family.value not in RENORM_FAMILIES or any(c.key == "moe.renorm" for c in out):
        return out
    return out + (Claim("moe.renorm", False, off.source + f" ({family.value!r} reads it)", tier=off.tier),)


def with_groups(claims: tuple[Claim, ...]) -> tuple[Claim, ...]:
    """DeepSeek's group limit (n_group, topk_group) as a moe.groups claim "n_group/topk_group": the experts in n_group
    contiguous groups, each token's experts among its topk_group best. Only where it limits (more than one group, fewer
    kept) and the router's topk_method is not "greedy" (DeepSeek-V2-Lite's, which reads neither); dropped otherwise."""
    said = {c.key: c for c in claims}
    out = tuple(c for c in claims if c.key not in (NGROUP, TOPKGROUP, TOPKMETHOD))
    groups, kept, method = said.get(NGROUP), said.get(TOPKGROUP), said.get(TOPKMETHOD)
    if groups is None or kept is None or any(c.key == "moe.groups" for c in out) or \
            (method is not None and method.value == "greedy"):
        return out
    g, k = int(groups.value), int(kept.value)
    if g != groups.value or k != kept.value or not 1 <= k < g:
        return out
    return out + (Claim("moe.groups", f"{g}/{k}", groups.source + f" and `topk_group` {k} (each token's experts among "
                        f"its {k} best of {g} groups)", tier=groups.tier),)


def with_ratio(claims: tuple[Claim, ...], gated, d_model: int | None) -> tuple[Claim, ...]:
    """The FFN's width over the model's (mlp_ratio) as an ffn.hidden claim of ratio x d_model, within one unit
    (timm's int() of it), where the card read an FFN that is not gated and no other claim names ffn.hidden; dropped
    otherwise."""
    out = tuple(c for c in claims if c.key != RATIO)
    ratio = next((c for c in claims if c.key == RATIO), None)
    if ratio is None or gated is not False or not d_model or any(c.key == "ffn.hidden" for c in out):
        return out
    width = ratio.value * d_model
    return out + (Claim("ffn.hidden", float(width), ratio.source, tol=1.0 / width),)


def with_window(claims: tuple[Claim, ...], seq: int) -> tuple[Claim, ...]:
    """An attn.window claim judged within one token either way, and only where the window (and one more) is shorter
    than the card's probe of `seq` tokens, which reads any longer window as none; dropped otherwise. A claim of no
    window stands as it is: the probe sees any window shorter than itself."""
    out = []
    for c in claims:
        if c.key == "attn.window" and c.source.startswith("the block's own") and c.value != "none":
            if not isinstance(c.value, (int, float)) or c.value + 1 >= seq:
                continue
            c = dataclasses.replace(c, value=float(c.value), tol=max(c.tol, 1.0 / c.value))
        out.append(c)
    return tuple(out)
