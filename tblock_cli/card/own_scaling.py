"""What a rotary-scaling dict (HF's rope_scaling, transformers 5's rope_parameters, litgpt's rope_adjustments) says
of the block: its kind and factor, llama-3's band ends, YaRN's and LongRoPE's attention factor, LongRoPE's per-pair
factors and a dynamic scaling's original length (the last ones pseudo keys `own_fit` turns into claims)."""

from __future__ import annotations

import math

from tblock_cli.card.own_names import (
    DYNAMIC,
    DYNAMICS,
    LONGROPE,
    LONGROPES,
    SCALED,
    SOFTMAX_GAIN,
    TYPED_BY_KEYS,
    YARN_GAIN,
    positive,
)


def scaling(d: dict) -> dict:
    """{rope.scaling: type, rope.factor: factor} from a rotary-scaling dict of a SCALED type with a factor above 1.
    YaRN claims its factor alone: the card tells its ramp from llama-3's only over three pairs or more in the band,
    which a narrow head may not have. LongRoPE claims its factors and attention factor, dynamic NTK its original length
    (pseudo keys the fitting turns into claims the card can judge)."""
    kind = d.get("rope_type", d.get("type")) or next((k for k, keys in TYPED_BY_KEYS.items() if keys <= d.keys()), None)
    factor = d.get("factor")
    if kind in LONGROPES + DYNAMICS:
        return _stretched(kind, d)
    if kind not in SCALED or isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        return {}
    out = ({} if kind == "yarn" else {"rope.scaling": kind}) | {"rope.factor": float(factor)}
    if kind == "yarn" and (soft := _softmax_gain(d, float(factor))) is not None:
        out[SOFTMAX_GAIN] = soft
    elif kind == "yarn" and (gain := _yarn_gain(d, float(factor))) is not None:
        out[YARN_GAIN] = gain
    if kind == "llama3":  # the band's ends: orig / low_freq_factor and orig / high_freq_factor (only their quotients)
        orig = d.get("original_max_position_embeddings", d.get("original_max_seq_len"))  # the latter litgpt's
        low, high = d.get("low_freq_factor"), d.get("high_freq_factor")
        if all(positive(v) for v in (orig, low, high)) and high > low:
            out |= {"rope.low_freq_wavelen": orig / low, "rope.high_freq_wavelen": orig / high}
    return out


def _stretched(kind: str, d: dict) -> dict:
    """The pseudo claims of a LongRoPE or dynamic NTK dict (transformers' _compute_longrope_parameters and
    _compute_dynamic_ntk_parameters): LONGROPE (short factors, long factors, original length) with the attention factor
    as YARN_GAIN (given, else sqrt(1 + ln(factor) / ln(original)) above a factor of 1); DYNAMIC, the original length."""
    orig = d.get("original_max_position_embeddings")
    orig = int(orig) if positive(orig) and orig > 1 else 0
    if kind in DYNAMICS:
        return {DYNAMIC: orig}
    factors = lambda v: tuple(float(f) for f in v) if isinstance(v, (list, tuple)) and v and all(map(positive, v)) \
        else None
    short, long = factors(d.get("short_factor")), factors(d.get("long_factor"))
    if short is None:
        return {}
    out = {LONGROPE: (short, long, orig)}
    given, factor = d.get("attention_factor"), d.get("factor")
    if positive(given):
        gain = float(given)
    elif positive(factor) and factor > 1 and orig:
        gain = math.sqrt(1 + math.log(factor) / math.log(orig))
    else:
        gain = None
    if gain is not None and gain != 1:
        out[YARN_GAIN] = gain
    return out


def _yarn_gain(d: dict, factor: float) -> float | None:
    """The gain YaRN's rotation puts on q and k: the dict's `attention_factor`, else 0.1 ln(factor) + 1 (HF's, the
    paper's sqrt(1/t)). None where `mscale` or `mscale_all_dim` is given: DeepSeek's split the gain between the rotary
    table and the softmax scale, over the rotating channels alone."""
    given = d.get("attention_factor")
    if given is not None:
        return float(given) if positive(given) else None
    if "mscale" in d or "mscale_all_dim" in d:
        return None
    return 0.1 * math.log(factor) + 1.0


def _softmax_gain(d: dict, factor: float) -> float | None:
    """DeepSeek's YaRN gain on the softmax scale (transformers' yarn_apply_mscale, DeepSeek's reference code): the
    scale times (0.1 mscale_all_dim ln(factor) + 1)^2, on every channel. Only where the rotary table itself is not
    scaled (its `attention_factor` 1, or `mscale` equal to `mscale_all_dim`: DeepSeek-V2-Lite's 0.707, V3's 1.0, whose
    ratio is 1): a gain on the rotating channels alone is no single score scale. None otherwise."""
    every = d.get("mscale_all_dim")
    if not positive(every):
        return None
    given, table = d.get("attention_factor"), d.get("mscale")
    if not (given == 1 if given is not None else positive(table) and table == every):
        return None
    return (0.1 * every * math.log(factor) + 1.0) ** 2
