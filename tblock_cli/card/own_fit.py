"""The block's own claims fitted to what its card could read: a rotating fraction turned into rope.dims once the head's
width is known, a kept window judged within one token and only where the probe can see it, a config's routing held
only against a mixture layer and its FFN width only against a dense one (an expert's width is another)."""

from __future__ import annotations

import dataclasses

from tblock_cli.card.entries import Card, Claim
from tblock_cli.card.own import FRACTION
from tblock_cli.card.own_names import RATIO, YARN_GAIN


def needed(claims: tuple[Claim, ...]) -> tuple[str, ...]:
    """The card keys to read for the block's own claims: theirs, and those `fitted` decides by."""
    keys = tuple(c.key for c in claims if c.key not in (FRACTION, RATIO, YARN_GAIN))
    if any(c.key.startswith("moe.") or c.key in ("ffn.hidden", RATIO) for c in claims):
        keys += ("moe.experts", "ffn.act")
    keys += ("ffn.gated", "ffn.hidden") if any(c.key == RATIO for c in claims) else ()
    keys += ("attn.scale",) if any(c.key == YARN_GAIN for c in claims) else ()
    return keys + (("attn.head_dim", "rope.dims") if any(c.key in (FRACTION, YARN_GAIN) for c in claims) else ())


def fitted(claims: tuple[Claim, ...], card: Card, seq: int, d_model: int | None = None) -> tuple[Claim, ...]:
    """The block's own claims as `card` can judge them (see the module's docstring); `seq` is the window probe's length.
    An FFN width is held only where the card fitted the FFN's curve: a hybrid layer's first `down` projection may be
    a Mamba mixer's (hf:jamba's and falcon_h1's read 1024 and 128 beside an intermediate_size of 2048)."""
    claims = with_fraction(claims, card.value("attn.head_dim"))
    claims = with_yarn_gain(claims, card.value("attn.head_dim"), card.value("rope.dims"))
    claims = with_window(with_ratio(claims, card.value("ffn.gated"), d_model), seq)
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


def with_yarn_gain(claims: tuple[Claim, ...], head_dim, rope_dims) -> tuple[Claim, ...]:
    """YaRN's attention factor m as an attn.scale claim: m on q and on k puts m^2 on every score, 1/sqrt(X) with
    X = head_dim / m^4. Only where every channel of the head rotates (HF puts m on the rotary table: a partial rotation
    scales some channels alone, no single scale) and no other claim names attn.scale; dropped otherwise."""
    out = tuple(c for c in claims if c.key != YARN_GAIN)
    gain = next((c for c in claims if c.key == YARN_GAIN), None)
    if gain is None or not head_dim or rope_dims != head_dim or any(c.key == "attn.scale" for c in out):
        return out
    return out + (Claim("attn.scale", float(head_dim) / gain.value ** 4, gain.source + " (YaRN's attention factor "
                        f"{gain.value:.4g} on q and k)"),)


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
