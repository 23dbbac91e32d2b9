"""What a block says it is, read from its own attributes and config: `rope_theta=500000` passed to a constructor and
kept, a config's `hidden_act`, an attention module's `softcap`. These are claims like `--expect`'s, held against the
card read off the block's behaviour: a block that keeps `rope_theta = 500000` and rotates with 10000 contradicts
itself. Only names whose meaning is not in doubt are read, on the modules where they mean it (a `base` only on a
rotary module, a `scale` only on an attention module); a key whose values disagree across the block claims nothing."""

from __future__ import annotations

import dataclasses
import math
import re

import torch.nn as nn

from tblock_cli.card.entries import Claim

# Not a card key: the rotating fraction of a head, turned into a rope.dims claim by `with_fraction`.
FRACTION = "rope.fraction"
# attribute or config field -> card key, read on any module or config.
FIELDS = {
    "rope_theta": "rope.theta", "rope_base": "rope.theta", "rotary_base": "rope.theta", "rotary_emb_base": "rope.theta",
    "rope_freq_base": "rope.theta",
    "rotary_dim": "rope.dims", "rotary_ndims": "rope.dims", "rope_dim": "rope.dims", "qk_rope_head_dim": "rope.dims",
    "attn_logit_softcapping": "attn.softcap", "logit_softcap": "attn.softcap", "logit_softcapping": "attn.softcap",
    "attn_softcap": "attn.softcap", "softcap": "attn.softcap", "attention_logit_softcapping": "attn.softcap",
    "query_pre_attn_scalar": "attn.scale", "attention_scores_scalar": "attn.scale",
    # the width of each head's q and k where a config gives it apart from the model's width (Gemma's 256 beside 3072 /
    # 16 = 192, Qwen3's 128 beside 2560 / 32 = 80): a port that splits hidden_size / heads contradicts it
    "head_dim": "attn.head_dim", "head_size": "attn.head_dim",
    # the FFN's hidden width, read from a config only (a `d_ff` argument is often tblock's own --d-ff default, which a
    # block may take and size its own way), and never Meta's `hidden_dim`, which its FeedForward turns into 2/3 of
    # itself rounded up, nor OLMo's `mlp_hidden_size`, gate and up together
    "intermediate_size": "ffn.hidden", "ffn_dim": "ffn.hidden", "n_inner": "ffn.hidden", "ffn_hidden_size": "ffn.hidden",
    "d_ff": "ffn.hidden", "dim_feedforward": "ffn.hidden",
    "hidden_act": "ffn.act", "hidden_activation": "ffn.act", "activation_function": "ffn.act", "activation": "ffn.act",
    "activation_fn": "ffn.act", "act_fn": "ffn.act", "ffn_activation": "ffn.act", "mlp_activation": "ffn.act",
    "num_experts_per_tok": "moe.top_k", "moe_top_k": "moe.top_k", "n_activated_experts": "moe.top_k",
    "num_local_experts": "moe.experts", "n_routed_experts": "moe.experts", "num_experts": "moe.experts",
    "moe_num_experts": "moe.experts", "n_expert": "moe.experts", "n_expert_per_token": "moe.top_k",
    "norm_topk_prob": "moe.renorm", "scoring_func": "moe.router", "routed_scaling_factor": "moe.scale",
    # a count or width of shared experts: above 0 claims one (DeepSeek's n_shared_experts, Qwen2-MoE's width)
    "n_shared_experts": "moe.shared", "num_shared_experts": "moe.shared", "shared_expert_intermediate_size": "moe.shared",
    # a fraction of each head's channels that rotate: rope.dims once the card has read the head's width
    "partial_rotary_factor": FRACTION, "rotary_pct": FRACTION, "rotary_percentage": FRACTION,
    "norm_eps": "norm.eps", "rms_norm_eps": "norm.eps", "layer_norm_eps": "norm.eps", "layer_norm_epsilon": "norm.eps",
    "layernorm_epsilon": "norm.eps",
    # a switch: True is the parallel form (attention and FFN read the same stream), False the sequential one
    "use_parallel_residual": "residual.form", "parallel_residual": "residual.form", "parallel_attn": "residual.form",
    # a switch: True pairs channels (2i, 2i + 1) (Meta's and DeepSeek-V3's layout), False (i, i + dims/2)
    "rope_interleave": "rope.pairing", "rope_interleaved": "rope.pairing", "rotary_interleaved": "rope.pairing",
    "interleaved_rope": "rope.pairing",
    # a switch: True claims a norm on q and k (per head or over the width: "any"), False none (Cohere's use_qk_norm,
    # StableLM's and Persimmon's qk_layernorm, Llama 4's use_qk_norm)
    "qk_norm": "attn.qk_norm", "use_qk_norm": "attn.qk_norm", "qk_layernorm": "attn.qk_norm",
    # torch's nn.TransformerEncoderLayer switch: True normalises each sublayer's input (pre), False the sum (post)
    "norm_first": "norm.placement",
    # how positions enter the layer, where it is one the layer itself applies: rotary or alibi (an "absolute" type is
    # added to the embeddings, outside any layer, and claims nothing)
    "position_embedding_type": "pos.kind",
    # Meta's ModelArgs switch for Llama 3.1's frequency scaling (apply_scaling): True claims llama-3's kind (its factor
    # is hard-coded in some versions, a field in others), False none
    "use_scaled_rope": "rope.scaling",
    "normalize_before": "norm.placement",  # fairseq's switch: True normalises each sublayer's input (pre), False the sum
    "rotary_emb_dim": "rope.dims",  # flash-attn's MHA: the rotating channels per head
    # Megatron's switch for a (1 + w) norm weight initialised at 0
    "layernorm_zero_centered_gamma": "norm.offset", "zero_centered_gamma": "norm.offset", "add_unit_offset": "norm.offset",
    "gelu_approximate": "ffn.act",  # litgpt's: "tanh" claims gelu_tanh, "none" nothing (its Llama MLPs never read it)
    # whether projections add a bias (Llama's attention_bias, mlp_bias, timm's qkv_bias, nanoGPT's bias): True claims
    # some does, False none does. The generic ones claim False only (True may mean the norms' biases), and only where no
    # other bias switch is True (litgpt's Qwen2: `bias` False for every linear but qkv, which `attn_bias` True adds)
    "qkv_bias": "bias.qkv", "use_qkv_bias": "bias.qkv", "add_qkv_bias": "bias.qkv", "attention_bias": "bias.attn",
    "mlp_bias": "bias.ffn", "bias": "bias.any", "use_bias": "bias.any", "add_bias_linear": "bias.any",
}
# Granite's muP multipliers (and every layer that copied them: HyperCLOVA X, NeoMME): `residual_multiplier` scales
# each sublayer's output at its add (x + m * f(x), attention and FFN alike), `attention_multiplier` is the score
# scale itself (q.k * m, the card's attn.scale 1 / m^2). A multiplier of 1 claims nothing: left out, nothing differs.
BRANCH_GAINS = ("residual.attn_gain", "residual.ffn_gain")
MULTIPLIERS = {"residual_multiplier": BRANCH_GAINS, "attention_multiplier": ("attn.scale",)}
# LayerScale's start (CaiT, DeiT III, DINOv2, BEiT): each branch's per-channel gain at its add, as built. timm's
# `init_values` is read only as a block's constructor argument (the name is too plain elsewhere).
LAYER_SCALES = ("layer_scale_init_value", "layerscale_value", "layer_scale_init", "layerscale_init_value",
                "ls_init_value", "layer_scale_init_values", "layerscale_init")
MULTIPLIERS.update({n: BRANCH_GAINS for n in LAYER_SCALES})
# a switch beside it that turns LayerScale off (FocalNet's use_layerscale=False next to its layerscale_value 1e-4)
LAYER_SCALE_SWITCHES = ("use_layerscale", "use_layer_scale", "layerscale", "layer_scale")


def _layer_scale_off(values: dict) -> dict:
    """values without their LayerScale start where a switch beside it is False."""
    if any(values.get(s) is False for s in LAYER_SCALE_SWITCHES):
        return {f: v for f, v in values.items() if f not in LAYER_SCALES and f != "init_values"}
    return values
# The card's words for a switch's True and False, for the keys a boolean field claims
SWITCHED = {"residual.form": ("parallel", "sequential"), "rope.pairing": ("interleaved", "half"),
            "attn.qk_norm": ("any", "none"), "norm.placement": ("pre", "post")}
# switches that, set True, claim pos.kind (False says nothing: a layer without positions of its own, NoPE's)
POSITION_SWITCHES = {"use_rotary": "rotary", "use_rope": "rotary", "use_alibi": "alibi"}
# a second rotary base for some layers (sliding-window ones): the config's base then speaks for the others only
LOCAL_BASES = ("rope_local_base_freq", "local_rope_theta", "rope_local_theta", "local_rope_base", "rope_local_base")
# the same switch the other way round: vLLM's is_neox_style (True: GPT-NeoX's half-split pairing)
HALF_SPLIT = ("is_neox_style",)
# Head counts, read together: a count of key/value heads (or of query heads per key/value head) beside a count of
# query heads claims attn.group, their ratio. The ratio, not the counts: a layer that splits each head in two
# (Differential Transformer's q1/q2, k1/k2) doubles both counts and keeps the ratio.
HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_query_groups", "multi_query_group_num")
GROUPS = ("num_key_value_groups", "n_rep")
# A multi-query switch set overrides a kv count that stays in the config (Falcon's `multi_query=True` beside its
# `num_kv_heads`, used only with `new_decoder_architecture`): where one is True the counts claim nothing.
MULTI_QUERY = ("multi_query", "multi_query_attention")
# attributes torch's own modules keep and compute with by construction (nn.MultiheadAttention's head_dim and
# num_heads): no claim
TORCH_KEPT = ("head_dim", "num_heads")
# Multi-head latent attention's widths: q and k are nope + rope channels, and DeepSeek's configs keep `head_dim` for the
# rope part alone; where one of these is read, `head_dim` claims nothing
MLA_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "qk_head_dim", "v_head_dim")
# a rotary scaling as configs write it (HF's rope_scaling, transformers 5's rope_parameters): a dict whose type is
# one of SCALED claims that scaling and its factor. "dynamic" is left out (it changes the table only past the
# original length, which a probe does not reach), and so is anything else the card has no name for.
SCALINGS = ("rope_scaling", "rope_parameters")
SCALED = ("linear", "llama3", "yarn")
# read only on a module whose class name says it is one of these
ON_ROTARY = {"base": "rope.theta", "theta": "rope.theta", "interleaved": "rope.pairing", "interleave": "rope.pairing"}
ON_ATTENTION = {"scale": "attn.scale", "scaling": "attn.scale", "softmax_scale": "attn.scale"}
# the unambiguous ones of those, read also on a module of another name that holds a query projection itself (a block
# written as one module): a bare `scale` there may be anything
ON_QUERY_HOLDER = {"scaling": "attn.scale", "softmax_scale": "attn.scale"}
QUERY_CHILDREN = ("q_proj", "query", "wq", "to_q", "q_lin", "qkv", "qkv_proj", "c_attn", "Wqkv", "query_key_value",
                  "in_proj", "att_proj", "W_pack")
# a sliding window the block keeps or was built with: read from its constructor's own arguments and its modules'
# attributes, never from a config (a config's window applies to some layers only: Gemma's, Qwen2's switch), and judged
# only where it is shorter than the card's probe (see `with_window`); conventions differ by one (a query sees w keys, or
# w + 1: HF's masks and flash-attention's), so one either way matches
WINDOWS = ("sliding_window",)
# A window of None says the layer attends to every key (a Hugging Face attention module's own sliding_window on its
# full-attention layers), and so does a switch that turns sliding off for the whole model (Qwen2's
# use_sliding_window=False, whatever sliding_window it also keeps)
WINDOW_SWITCHES = ("use_sliding_window",)
# read only on a norm module written outside torch (torch's own use the eps they keep, by construction)
ON_NORM = {"eps": "norm.eps", "variance_epsilon": "norm.eps"}
# activation names as configs write them -> the card's
BIAS_ON = "<a bias switch on>"  # among the names seen: a generic bias switch's False claims nothing then
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu", "relu": "relu", "quick_gelu": "quick_gelu",
        "relu2": "relu2", "relu_squared": "relu2"}


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

    def fields(values: dict, where: str) -> None:
        for field, v, at in fields_of(values, where):
            seen.add(field)
            seen.update([BIAS_ON] if v is True and "bias" in field.lower() else [])
            if FIELDS.get(field) == "ffn.hidden" and at == "constructor argument":
                continue
            if field in FIELDS:
                v = {"tanh": "gelu_tanh"}.get(v) if field == "gelu_approximate" else v
                put(asked, FIELDS[field], _value(FIELDS[field], v), f"{at} `{field}`")
            elif field in MULTIPLIERS or (field == "init_values" and at == "constructor argument"):
                for key in MULTIPLIERS.get(field, BRANCH_GAINS):
                    put(asked, key, _multiplier(key, v), f"{at} `{field}`")
            elif field in HEADS + KV_HEADS + GROUPS:
                put(asked, f"count.{field}", _count(v), f"{at} `{field}`")
            elif field in MULTI_QUERY and v is True:
                put(asked, "count.multi_query", True, f"{at} `{field}`")
            elif field in SCALINGS and isinstance(v, dict):
                for key, value in _scaling(v).items():
                    put(asked, key, value, f"{at} `{field}`")
            elif field in WINDOWS and at == "constructor argument":
                put(asked, "attn.window", _window(v), f"{at} `{field}`")
            elif field in WINDOW_SWITCHES and v is False:
                put(asked, "attn.window", "none", f"{at} `{field}`")
            elif field in HALF_SPLIT and isinstance(v, bool):
                put(asked, "rope.pairing", _value("rope.pairing", not v), f"{at} `{field}`")
            elif field in POSITION_SWITCHES and v is True:
                put(asked, "pos.kind", POSITION_SWITCHES[field], f"{at} `{field}`")

    fields(_layer_scale_off(arguments or {}), "constructor argument")
    for m in modules:
        cls, owner = type(m).__name__.lower(), type(m).__name__
        for name, value in _layer_scale_off(vars(m)).items():
            if name.startswith("_"):
                continue
            seen.add(name)
            seen.update([BIAS_ON] if value is True and "bias" in name.lower() else [])
            if name in TORCH_KEPT and type(m).__module__.startswith("torch."):
                continue
            if is_config(value):
                fields(config_fields(value), f"{owner}.{name}'s")
                continue
            if name in HEADS + KV_HEADS + GROUPS:
                put(kept, f"count.{name}", _count(value), f"{owner}.{name}")
                continue
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
                put(kept, "attn.window", "none", f"{owner}.{name}")
                continue
            if name in HALF_SPLIT and isinstance(value, bool):
                put(kept, "rope.pairing", _value("rope.pairing", not value), f"{owner}.{name}")
                continue
            if name in POSITION_SWITCHES and value is True:
                put(kept, "pos.kind", POSITION_SWITCHES[name], f"{owner}.{name}")
                continue
            key = ((FIELDS.get(name) if FIELDS.get(name) != "ffn.hidden" else None) or (ON_ROTARY.get(name) if is_rotary_name(owner) else None)
                   or (ON_NORM.get(name) if own_norm(m) else None))
            if key is not None:
                put(kept, key, _value(key, value), f"{owner}.{name}")
            elif ("attn" in cls or "attention" in cls) and name in ON_ATTENTION:
                put(kept, ON_ATTENTION[name], _scale_claim(value), f"{owner}.{name}")
            elif name in ON_QUERY_HOLDER and any(c in m._modules for c in QUERY_CHILDREN):
                put(kept, ON_QUERY_HOLDER[name], _scale_claim(value), f"{owner}.{name}")
    named = {}  # last: what class names say, where nothing else speaks
    norms = [type(m).__name__ for m in modules if "norm" in type(m).__name__.lower()]
    if norms and all(is_rms_name(n) for n in norms):
        put(named, "norm.kind", "rmsnorm", f"class name `{norms[0]}` (every norm's class says RMSNorm)")
    for tier in (asked, kept):
        _group(tier)
    if BIAS_ON in seen:
        for tier in (asked, kept):
            tier.pop("bias.any", None)
    if seen.intersection(MLA_WIDTHS):
        for tier in (asked, kept):
            tier.pop("attn.head_dim", None)
    claims = []
    for key in {**named, **kept, **asked}:
        tier, values = next((t, v[key]) for t, v in (("asked", asked), ("kept", kept), ("named", named)) if v.get(key))
        if len(values) == 1:
            (value, where), = values.items()
            claims.append(Claim(key, value, f"the block's own {where}", tier=tier, multiple=key == "attn.heads"))
    return tuple(claims)


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

    heads, kv, group = one(HEADS), one(KV_HEADS), one(GROUPS)
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


def is_config(value) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (
        callable(getattr(value, "to_dict", None)) and hasattr(value, "model_type"))


def config_fields(config) -> dict:
    """A config's fields; transformers 5 keeps the rotary base in `rope_parameters`. A config that also holds a local
    layers' base (Gemma-3's sliding layers rotate at 10000, its global ones at 1e6) claims neither: a layer's base
    depends on its index."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in fields:
        fields["rope_theta"] = rope["rope_theta"]
    fields = _layer_scale_off(fields)
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
    if key.startswith("bias.") or key == "norm.offset":
        return v if isinstance(v, bool) else None
    if key in SWITCHED:
        return SWITCHED[key][not v] if isinstance(v, bool) else None
    if key == "moe.router":
        return v.lower() if isinstance(v, str) and v.lower() in ("softmax", "sigmoid") else None
    if key == FRACTION and isinstance(v, (int, float)) and not 0 < v <= 1:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None  # a switch, a word, or 0/None for "off": nothing measured to hold it against
    return float(v)


def _scaling(d: dict) -> dict:
    """{rope.scaling: type, rope.factor: factor} from a rotary-scaling dict of a SCALED type with a factor above 1.
    YaRN claims its factor alone: the card tells its ramp from llama-3's only over three pairs or more in the band,
    which a narrow head may not have."""
    kind, factor = d.get("rope_type", d.get("type")), d.get("factor")
    if kind not in SCALED or isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        return {}
    out = ({} if kind == "yarn" else {"rope.scaling": kind}) | {"rope.factor": float(factor)}
    if kind == "llama3":  # the band's ends: orig / low_freq_factor and orig / high_freq_factor (only their quotients)
        orig, low, high = (d.get(k) for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"))
        if all(_value("rope.factor", v) for v in (orig, low, high)) and high > low:
            out |= {"rope.low_freq_wavelen": orig / low, "rope.high_freq_wavelen": orig / high}
    return out


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
