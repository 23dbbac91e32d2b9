"""What a block says it is, read from its own attributes and config: `rope_theta=500000` passed to a constructor and
kept, a config's `hidden_act`, an attention module's `softcap`. These are claims like `--expect`'s, held against the
card read off the block's behaviour: a block that keeps `rope_theta = 500000` and rotates with 10000 contradicts
itself. Only names whose meaning is not in doubt are read, on the modules where they mean it (a `base` only on a
rotary module, a `scale` only on an attention module); a key whose values disagree across the block claims nothing."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import torch.nn as nn
import torch.nn.functional as F

from tblock_cli.card.entries import Claim
from tblock_cli.card.own_names import (
    ACTS,
    BIAS_ON,
    BRANCH_GAINS,
    BY_LAYER,
    CALLABLE_ACTS,
    CLASS_ACTS,
    FAMILY,
    FIELDS,
    FRACTION,
    FUNCTION_ACTS,
    GATED_MLPS,
    GROUPS,
    HALF_SPLIT,
    HEADS,
    KV_HEADS,
    LLAMA3_BAND,
    LOCAL_BASES,
    LOCAL_KV_HEADS,
    META_LOCAL,
    MLA_WIDTHS,
    MULTI_QUERY,
    MULTIPLIERS,
    NORM_AFTER,
    NORM_KINDS,
    ON_ATTENTION,
    ON_NORM,
    ON_QUERY_HOLDER,
    ON_RELATIVE,
    ON_ROTARY,
    PLACED_FIRST,
    POSITION_SWITCHES,
    QUERY_CHILDREN,
    RELBUCKETS,
    RELMAX,
    RELONEWAY,
    RENORM_OFF,
    SCALINGS,
    SWITCHED,
    TOPKMETHOD,
    TORCH_KEPT,
    UNSCALED,
    WINDOW_SWITCHES,
    WINDOWS,
    derived_fields,
    layer_scale_off,
)
from tblock_cli.card.own_scaling import scaling as _scaling


def own_claims(modules: list[nn.Module], arguments: dict | None = None) -> tuple[Claim, ...]:
    """Claims from the block's constructor arguments (defaults included), its modules' attributes and the configs among
    either (dataclasses, objects with `to_dict`). Arguments and configs come first; a module's attribute (a rotary
    module's `base`) speaks for a key only where they are silent. A key given two values in one tier is left out."""
    asked: dict[str, dict] = {}  # key -> value -> where: arguments and configs
    kept: dict[str, dict] = {}  # the same for modules' own attributes

    def put(tier: dict, key: str, value, where: str) -> None:
        if value is not None:
            tier.setdefault(key, {}).setdefault(value, where)

    seen: set[str] = set()  # every field and attribute name read (multi-head latent attention's widths, below)
    switched_off: dict[str, str] = {}  # tier -> where a sliding switch is False (it wins over a window beside it)

    def fields(values: dict, where: str) -> None:
        for field, v, at in fields_of(values, where):
            seen.add(field)
            if v is True and "bias" in field.lower():  # another bias switch on: a generic bias=False claims nothing
                seen.add(BIAS_ON)
            if FIELDS.get(field) == "ffn.hidden" and at == "constructor argument":
                continue
            if field in PLACED_FIRST and v is not None:
                put(asked, "rope.place", "first", f"{at} `{field}` (a partial rotation turns the head's first channels)")
            if FIELDS.get(field) == "moe.renorm" and v is False:
                put(asked, RENORM_OFF, True, f"{at} `{field}`")
            if field in FIELDS:
                v = {"tanh": "gelu_tanh"}.get(v) if field == "gelu_approximate" else v
                v = act_layer(v) if field in CALLABLE_ACTS and not isinstance(v, str) else v
                put(asked, FIELDS[field], _value(FIELDS[field], v), f"{at} `{field}`")
            elif field in MULTIPLIERS or (field == "init_values" and at == "constructor argument"):
                for key in MULTIPLIERS.get(field, BRANCH_GAINS):
                    put(asked, key, _multiplier(key, v), f"{at} `{field}`")
            elif field in HEADS + KV_HEADS + GROUPS or (field in LOCAL_KV_HEADS and META_LOCAL not in values):
                put(asked, f"count.{field}", _count(v), f"{at} `{field}`")
            elif field in MULTI_QUERY and v is True:
                put(asked, "count.multi_query", True, f"{at} `{field}`")
            elif field in SCALINGS and isinstance(v, dict):
                for key, value in _scaling(v).items():
                    put(asked, key, value, f"{at} `{field}`")
            elif field in WINDOWS and at == "constructor argument":
                put(asked, "attn.window", _window(v), f"{at} `{field}`")
            elif field in WINDOW_SWITCHES and v is False:
                switched_off.setdefault("asked", f"{at} `{field}`")
            elif field in HALF_SPLIT and isinstance(v, bool):
                put(asked, "rope.pairing", _value("rope.pairing", not v), f"{at} `{field}`")
            elif field in POSITION_SWITCHES and v is True:
                put(asked, "pos.kind", POSITION_SWITCHES[field], f"{at} `{field}`")
            elif field in NORM_AFTER and isinstance(v, bool):
                put(asked, "norm.placement", NORM_AFTER[field][not v], f"{at} `{field}`")
            elif field == "model_type" and isinstance(v, str) and v:
                put(asked, FAMILY, v, f"{at} `{field}`")
            elif field == UNSCALED and v is False and values.get(BY_LAYER) is not True:  # by layer: own_layers
                put(asked, "attn.scale", 1.0, f"{at} `{field}` (scores not divided by sqrt(d_head))")

    fields(derived_fields(layer_scale_off(arguments or {})), "constructor argument")
    for m in modules:
        cls, owner = type(m).__name__.lower(), type(m).__name__
        for name, value in derived_fields(layer_scale_off(vars(m))).items():
            if name.startswith("_"):
                continue
            seen.add(name)
            if value is True and "bias" in name.lower():
                seen.add(BIAS_ON)
            if name in TORCH_KEPT and type(m).__module__.startswith("torch."):
                continue
            if is_config(value):
                fields(config_fields(value), f"{owner}.{name}'s")
                continue
            if name in HEADS + KV_HEADS + GROUPS or (name in LOCAL_KV_HEADS and META_LOCAL not in vars(m)):
                put(kept, f"count.{name}", _count(value), f"{owner}.{name}")
                continue
            if name in PLACED_FIRST and value is not None:
                put(kept, "rope.place", "first", f"{owner}.{name} (a partial rotation turns the head's first channels)")
            if name in MULTIPLIERS:
                for key in MULTIPLIERS[name]:
                    put(kept, key, _multiplier(key, value), f"{owner}.{name}")
                continue
            if name in MULTI_QUERY and value is True:
                put(kept, "count.multi_query", True, f"{owner}.{name}")
                continue
            if name in SCALINGS and isinstance(value, dict):
                for key, v in _scaling(value).items():
                    put(kept, key, v, f"{owner}.{name}")
                continue
            if name in WINDOWS:
                put(kept, "attn.window", _window(value), f"{owner}.{name}")
                continue
            if name in WINDOW_SWITCHES and value is False:
                switched_off.setdefault("kept", f"{owner}.{name}")
                continue
            if name in HALF_SPLIT and isinstance(value, bool):
                put(kept, "rope.pairing", _value("rope.pairing", not value), f"{owner}.{name}")
                continue
            if name == "scale_factor" and is_rotary_name(owner) and set(LLAMA3_BAND.values()) <= vars(m).keys():
                band = {k: getattr(m, a) for k, a in LLAMA3_BAND.items()}
                for key, v in _scaling({"rope_type": "llama3", "factor": value, **band}).items():
                    put(kept, key, v, f"{owner}.scale_factor")
                continue
            if name in POSITION_SWITCHES and value is True:
                put(kept, "pos.kind", POSITION_SWITCHES[name], f"{owner}.{name}")
                continue
            if name in NORM_AFTER and isinstance(value, bool):
                put(kept, "norm.placement", NORM_AFTER[name][not value], f"{owner}.{name}")
                continue
            key = ((FIELDS.get(name) if FIELDS.get(name) != "ffn.hidden" else None) or (ON_ROTARY.get(name) if is_rotary_name(owner) else None)
                   or (ON_NORM.get(name) if own_norm(m) else None)
                   or (ON_RELATIVE.get(name) if "relative" in cls and ("bias" in cls or "position" in cls) else None))
            if key is not None:
                value = act_layer(value) if name in CALLABLE_ACTS and not isinstance(value, str) else value
                put(kept, key, _value(key, value), f"{owner}.{name}")
            elif ("attn" in cls or "attention" in cls) and name in ON_ATTENTION:
                put(kept, ON_ATTENTION[name], _scale_claim(value), f"{owner}.{name}")
            elif name in ON_QUERY_HOLDER and any(c in m._modules for c in QUERY_CHILDREN):
                put(kept, ON_QUERY_HOLDER[name], _scale_claim(value), f"{owner}.{name}")
    named = {}  # last: what class names say, where nothing else speaks
    norms = [type(m).__name__ for m in modules if "norm" in type(m).__name__.lower()]
    if norms and all(is_rms_name(n) for n in norms):
        put(named, "norm.kind", "rmsnorm", f"class name `{norms[0]}` (every norm's class says RMSNorm)")
    elif (held := [m for m in modules if own_norm(m) and getattr(getattr(m, "weight", None), "ndim", 0) == 1]) and all(
            is_layer_norm(m) for m in held):  # torch's own LayerNorm does what it says by construction: no claim
        put(named, "norm.kind", "layernorm",
            f"class name `{type(held[0]).__name__}` with a bias (every norm's class written here says LayerNorm)")
    for m in modules:  # an FFN's or activation's class name (SwiGLU, ReLUSquared, QuickGELU): silent where others speak
        said = class_act(type(m))
        for key, value in zip(("ffn.gated", "ffn.act"), said or ()):
            if value is not None:
                put(named, key, value, f"class name `{type(m).__name__}`")
    for name, where in switched_off.items():  # Qwen2's use_sliding_window=False: no window, whatever one is kept
        {"asked": asked, "kept": kept}[name]["attn.window"] = {"none": where}
    for tier in (asked, kept):
        _group(tier)
    if BIAS_ON in seen:
        for tier in (asked, kept):
            tier.pop("bias.any", None)
    if seen.intersection(MLA_WIDTHS):
        for tier in (asked, kept):
            tier.pop("attn.head_dim", None)
            tier.pop("rope.place", None)
    if not any(RELBUCKETS in tier for tier in (asked, kept)):  # a direction or distance alone says nothing
        for tier in (asked, kept):
            tier.pop(RELMAX, None)
            tier.pop(RELONEWAY, None)
    claims = []
    for key in {**named, **kept, **asked}:
        tier, values = next((t, v[key]) for t, v in (("asked", asked), ("kept", kept), ("named", named)) if v.get(key))
        if len(values) == 1:
            (value, where), = values.items()
            claims.append(Claim(key, value, f"the block's own {where}", tier=tier, multiple=key == "attn.heads"))
    return tuple(claims) if any(c.key != FAMILY for c in claims) else ()  # a family alone claims nothing judged


def _window(v) -> int | str | None:
    return "none" if v is None else _count(v)


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _group(tier: dict) -> None:
    """Turn a tier's head counts (count.* keys, each with one value) into its attn.group claim, in place: query heads
    over key/value heads, or a group size itself. Counts that disagree, or a ratio that is not whole, claim nothing."""
    counts = {k.removeprefix("count."): v for k, v in tier.items() if k.startswith("count.")}
    for k in list(tier):
        if k.startswith("count."):
            del tier[k]

    def one(names) -> tuple[int, str] | None:
        found = {value: where for n in names for value, where in counts.get(n, {}).items()}
        return next(iter(found.items())) if len(found) == 1 else None

    heads, kv, group = one(HEADS), one(KV_HEADS + LOCAL_KV_HEADS), one(GROUPS)
    if heads:  # query heads: the product may split each in two (differential attention), so a multiple matches
        tier["attn.heads"] = {float(heads[0]): heads[1]}
    if "multi_query" in counts:
        return
    claimed = {}
    if heads and kv and heads[0] % kv[0] == 0:
        claimed[float(heads[0] // kv[0])] = f"{heads[1]} over {kv[1]}"
    if group:
        claimed.setdefault(float(group[0]), group[1])
    if len(claimed) == 1:
        tier["attn.group"] = claimed
        (group, where), = claimed.items()
        if group > 1:  # grouped-query attention has one layout: query head h reads key head h // group
            tier["attn.kv_grouping"] = {"contiguous": f"{where} (grouped query heads read key head h // {int(group)}, "
                                                      "as sdpa's enable_gqa and transformers' repeat_kv)"}


def fields_of(values: dict, where: str):
    """(field, value, where) for each field of values and of the configs among them, nested ones included."""
    for field, v in values.items():
        if is_config(v):
            yield from fields_of(config_fields(v), f"{where} `{field}`'s")
        else:
            yield field, v, where


def own_norm(m: nn.Module) -> bool:
    """A norm module written outside torch (torch's own norms use the eps they keep, by construction)."""
    return "norm" in type(m).__name__.lower() and not type(m).__module__.startswith("torch.")


def is_rms_name(name: str) -> bool:
    """A class name that says RMSNorm (RMSNorm, LlamaRMSNorm, rms_norm)."""
    return bool(re.search(r"rms_?norm", name, re.I))


def is_layer_norm(m: nn.Module) -> bool:
    """A module whose class name says LayerNorm (LayerNorm, GPT2LayerNorm, layer_norm) and that keeps a bias, a 1-D
    parameter beside its weight: T5's and its kin's bias-free `T5LayerNorm` is an RMSNorm by design, a LayerNorm with a
    bias is not."""
    b = getattr(m, "bias", None)
    return (bool(re.search(r"layer_?norm$", type(m).__name__, re.I)) and not is_rms_name(type(m).__name__)
            and isinstance(b, nn.Parameter) and b.ndim == 1)


def is_config(value) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (
        callable(getattr(value, "to_dict", None)) and hasattr(value, "model_type"))


def config_fields(config) -> dict:
    """A config's fields; transformers 5 keeps the rotary base in `rope_parameters`. A config that also holds a local
    layers' base (Gemma-3's sliding layers rotate at 10000, its global ones at 1e6) claims neither: a layer's base
    depends on its index."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    kind = getattr(config, "model_type", None)  # transformers keeps it on the class
    if isinstance(kind, str) and kind:
        fields.setdefault("model_type", kind)
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in fields:
        fields["rope_theta"] = rope["rope_theta"]
    fields = derived_fields(layer_scale_off(fields))
    if any(fields.get(f) is not None for f in LOCAL_BASES):
        fields = {f: v for f, v in fields.items() if FIELDS.get(f) != "rope.theta"}
    if any(_count(v) and FIELDS.get(f) != "ffn.hidden" and re.search("intermediate|ffn|inner", f) for f, v in fields.items()):
        # another FFN width beside (Llama 4's intermediate_size_mlp, an expert's or a shared expert's): which a layer
        # uses depends on the layer
        fields = {f: v for f, v in fields.items() if FIELDS.get(f) != "ffn.hidden"}
    return fields


def _value(key: str, v):
    """A config value as the card writes it, or None where it claims nothing the card can hold against it."""
    if key == "ffn.act":
        return ACTS.get(v.lower()) if isinstance(v, str) else None
    if key == "norm.kind":
        return NORM_KINDS.get(v.lower()) if isinstance(v, str) else None
    if key == "ffn.gated" and isinstance(v, str):
        return GATED_MLPS.get(v)
    if key == "moe.renorm":
        # only True asks for something: False is many configs' default, kept by layers whose router renormalises by
        # construction (litgpt declares it False for every model, Mixtral's included, and takes the softmax after
        # the top-k, which renormalises)
        return True if v is True else None
    if key == "moe.shared":  # only a positive count claims: 0 or None is many configs' default for "no shared expert"
        return True if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
    if key == "pos.kind":
        return v.lower() if isinstance(v, str) and v.lower() in ("rotary", "alibi") else None
    if key == "rope.scaling":
        return ("llama3" if v else "none") if isinstance(v, bool) else None
    if key == "bias.any":  # a generic switch may govern the norms' biases too: only False (no bias anywhere) is judged
        return False if v is False else None
    if key.startswith("bias.") or key in ("norm.offset", "ffn.gated", RELONEWAY):
        return v if isinstance(v, bool) else None
    if key in SWITCHED:
        return SWITCHED[key][not v] if isinstance(v, bool) else None
    if key == "attn.causal":  # a bidirectional switch: True claims no causal mask, False nothing
        return False if v is True else None
    if key == TOPKMETHOD:
        return v.lower() if isinstance(v, str) and v else None
    if key == "moe.router":
        return v.lower() if isinstance(v, str) and v.lower() in ("softmax", "sigmoid") else None
    if key == FRACTION and isinstance(v, (int, float)) and not 0 < v <= 1:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None  # a switch, a word, or 0/None for "off": nothing measured to hold it against
    return float(v)


# torch's activation classes as a layer argument names them (timm's and open_clip's `act_layer=nn.GELU`)
TORCH_ACTS = {nn.GELU: "gelu", nn.SiLU: "silu", nn.ReLU: "relu"}


def act_layer(v) -> str | None:
    """The activation a class or function names, as `act_layer` (timm's, open_clip's) and `activation_func`
    (Megatron's) give it: torch's class (nn.GELU exact, unless a partial says approximate="tanh"), one named for it
    (open_clip's QuickGELU), a function by its name (F.gelu, Megatron's squared_relu); else None."""
    if isinstance(v, functools.partial):
        tanh = v.keywords.get("approximate") == "tanh"
        return "gelu_tanh" if tanh and v.func in (nn.GELU, F.gelu) else None if tanh else act_layer(v.func)
    if isinstance(v, type):
        if v in TORCH_ACTS:
            return TORCH_ACTS[v]
        said = class_act(v)
        return said[1] if said and isinstance(said[1], str) and said[0] is None else None
    return FUNCTION_ACTS.get(getattr(v, "__name__", None)) if callable(v) and not isinstance(v, nn.Module) else None


def class_act(cls: type) -> tuple | None:
    """(ffn.gated, ffn.act) a module's class name says (CLASS_ACTS), or None; torch's own classes say nothing."""
    if cls.__module__.startswith("torch."):
        return None
    name = re.sub(r"[^a-z0-9]", "", cls.__name__.lower())
    name = name[: -len("activation")] if name.endswith("activation") else name
    return next((v for k, v in CLASS_ACTS.items() if name.startswith(k)), None)


def is_rotary_name(name: str) -> bool:
    """A class name that says rotary or RoPE (LlamaRotaryEmbedding, Llama3ScaledRoPE, RopeEmbedding; not DropEmbed)."""
    return bool(re.search(r"[Rr]otary|ROTARY|(?:^|[a-z0-9_])(?:RoPE|Rope|ROPE|rope)(?=[A-Z0-9_]|$)", name)) and \
        not re.search(r"no_?rope|nope", name, re.I)


def _multiplier(key: str, v):
    """A Granite multiplier as the card writes it: the score scale's X = 1 / m^2, or the branch gain m itself; None for
    1 (the default, nothing to hold against) and for anything not a positive finite number."""
    if v == 1:
        return None
    return _scale_claim(v) if key == "attn.scale" else _value(key, v)


def _scale_claim(v):
    """An attention module's score scale s (the factor on q.k) as the card's attn.scale X = 1 / s**2."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
        return None
    return 1.0 / (v * v)
