"""A transformers config of tblock's sizes: every size-dependent field scaled with them, --kwargs validated."""

from __future__ import annotations

import difflib

from tblock_cli.config import BlockConfig
from tblock_cli.errors import ConfigError, LoadError

# The embeddings are never used (tblock feeds hidden states): a small vocabulary keeps them cheap.
VOCAB = 256
# --kwargs keys that steer tblock's driving, not the config.
DRIVER_KEYS = ("attn_implementation", "stack")

# embedding_size (albert), input_embedding_size (rembert): factorised embeddings mapped to the layers' width outside
# the layers; tblock's x stands for that mapping's output, so the placeholder it replaces takes the same width.
D_MODEL = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "embedding_size", "input_embedding_size")
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
         "decoder_attention_heads", "num_decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers", "num_decoder_layers",
          "num_encoder_layers")
# The FFN's hidden width under every name seen in transformers configs (ctrl's dff, distilbert's hidden_dim, ...).
FFN = ("intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "dff", "d_inner",
       "ffn_hidden_size", "intermediate_dim", "inner_hidden_size", "decoder_intermediate_size")
# An expert's width: the FFN a mixture-of-experts layer runs (qwen3_moe has no dense FFN in any layer by default).
EXPERT_FFN = ("moe_intermediate_size", "expert_intermediate_size", "expert_ffn_hidden_size")
# Widths of other FFNs in the same layer (shared experts): kept in the family's proportion to an expert's.
FFN_RELATIVE = ("shared_expert_intermediate_size", "mlp_hidden_size", "dense_intermediate_size")
# Fields measured in head dimensions: scaled by new head_dim / the checkpoint's head_dim.
PER_HEAD = ("head_dim", "d_kv", "d_head", "kv_channels", "attention_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "qk_head_dim", "rotary_dim", "rotary_emb_dim", "query_pre_attn_scalar", "global_head_dim",
            "local_head_dim")
EVEN = ("rotary_dim", "rotary_emb_dim", "qk_rope_head_dim")  # split into (cos, sin) halves
# Fields measured in model widths: scaled by new d_model / the checkpoint's.
PER_WIDTH = ("q_lora_rank", "kv_lora_rank", "word_embed_proj_dim", "project_dim", "mamba_d_ssm", "mamba_n_heads")
DROPOUT_WORDS = ("dropout", "pdrop", "drop_prob")
# A negative value for a field named like these is a mistake, not a setting.
NON_NEGATIVE_WORDS = ("size", "window", "dim", "head", "layer", "rank", "expert", "num_", "n_", "length", "position")


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise LoadError("--block hf:TYPE needs transformers: pip install 'tblock[hf]'") from None
    transformers.logging.set_verbosity_error()  # config notes about token ids of a vocabulary tblock never uses
    return transformers


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def default_config(model_type: str):
    transformers = import_transformers()
    if not model_type:
        raise LoadError("--block hf:TYPE needs a transformers model type, e.g. hf:gpt2, hf:bert, hf:llama")
    try:
        return transformers.AutoConfig.for_model(model_type)
    except Exception as e:  # noqa: BLE001 - an unknown type, or a config class that fails on its own defaults
        known = sorted(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
        close = difflib.get_close_matches(model_type.lower().replace("-", "_"), known, n=5, cutoff=0.6)
        if model_type in known:
            raise LoadError(f"--block hf:{model_type}: its config cannot be built: {one_line(e)}") from None
        raise LoadError(f"--block hf:{model_type}: not a transformers model type; "
                        f"{'did you mean ' + ', '.join(close) if close else 'e.g. gpt2, bert, llama, qwen2, mistral'}") from None


def settable(config, name: str) -> bool:
    """A field the config has and can take (falcon's head_dim is a read-only property computed from the sizes)."""
    prop = getattr(type(config), name, None)
    return hasattr(config, name) and not (isinstance(prop, property) and prop.fset is None)


def config_keys(config) -> set[str]:
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}))


# Rotary settings as transformers 4 configs spelled them, and where transformers 5 keeps them: in one
# `rope_parameters` dict. A --kwargs (or --like-kwargs) written for either release means the same block.
LEGACY_ROPE = {"rope_theta": "rope_theta", "rotary_emb_base": "rope_theta", "rotary_pct": "partial_rotary_factor",
               "partial_rotary_factor": "partial_rotary_factor"}


def legacy_rope(config, extra: dict) -> dict:
    """--kwargs with the transformers 4 rotary keys (rope_theta, rope_scaling, rotary_pct, ...) moved into the
    config's `rope_parameters`, where the config keeps them there and has no field of the old name."""
    known = config_keys(config)
    moved = [k for k in (*LEGACY_ROPE, "rope_scaling") if k in extra and k not in known]
    if "rope_parameters" not in known or not moved:
        return extra
    params = dict(extra.get("rope_parameters") or getattr(config, "rope_parameters", None) or {})
    scaling = extra.get("rope_scaling") if "rope_scaling" in moved else None
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        params.update(scaling)
    for k in moved:
        if k != "rope_scaling":
            params[LEGACY_ROPE[k]] = extra[k]
    return {**{k: v for k, v in extra.items() if k not in moved}, "rope_parameters": params}


def validate_kwargs(model_type: str, config, extra: dict) -> None:
    """Refuse --kwargs keys the config does not have (naming close ones) and values of the wrong kind."""
    known = config_keys(config)
    for key, value in extra.items():
        if key in DRIVER_KEYS:
            continue
        if key not in known and not settable(config, key):
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"see {type(config).__name__}'s fields"
            raise ConfigError(f"--kwargs: {model_type}'s config has no field {key!r}; {hint}")
        default = getattr(config, key, None)
        if default is not None and not callable(default):
            numeric = (int, float)
            if isinstance(default, bool) != isinstance(value, bool) or \
                    (isinstance(default, numeric) and not isinstance(value, numeric)) or \
                    (isinstance(default, str) and not isinstance(value, str)):
                raise ConfigError(f"--kwargs: {key} of {model_type} takes a {type(default).__name__} "
                                  f"(default {default!r}), got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0 and \
                any(w in key.lower() for w in NON_NEGATIVE_WORDS):
            raise ConfigError(f"--kwargs: {key} must be >= 0, got {value}")


def size_overrides(config, cfg: BlockConfig, extra: dict) -> dict:
    """Config fields for tblock's sizes, each under the names this config uses, in the family's proportions."""
    d0 = next((getattr(config, n) for n in D_MODEL if isinstance(getattr(config, n, None), int)), None)
    h0 = next((getattr(config, n) for n in HEADS if isinstance(getattr(config, n, None), int)), None)
    head0 = getattr(config, "head_dim", None)
    head0 = head0 if isinstance(head0, int) and head0 > 0 else (d0 // h0 if d0 and h0 else None)
    ffn0 = next((getattr(config, n) for n in EXPERT_FFN + FFN if isinstance(getattr(config, n, None), int)), None)
    d, h, head = cfg.d_model, cfg.n_heads, cfg.head_dim
    # token ids past the small vocabulary dropped; those inside kept (roberta counts positions from its pad id)
    out: dict = {"vocab_size": VOCAB, **{n: None for n in ("pad_token_id", "bos_token_id", "eos_token_id")
                                         if not (isinstance(getattr(config, n, None), int) and getattr(config, n) < VOCAB)}}

    fields = config.to_dict()

    def put(name, value):  # real fields only: prophetnet refuses num_hidden_layers, an alias of its own
        if name not in extra and name in fields and settable(config, name):
            out[name] = value

    for n in D_MODEL:
        put(n, d)
    if hasattr(config, "hidden_dim") and hasattr(config, "dim"):  # distilbert: dim is the width, hidden_dim the FFN's
        put("hidden_dim", cfg.ffn_dim)
    for n in HEADS:
        if isinstance(getattr(config, n, None), int):
            put(n, h)
    for n in KV_HEADS:
        k0 = getattr(config, n, None)
        if k0 is None:  # None reads as one kv head per head, but some families' layers divide by it
            put(n, h)
        elif isinstance(k0, int) and not isinstance(k0, bool) and h0:  # the family's grouping kept: q heads per kv head
            put(n, max(1, h * k0 // h0) if (h * k0) % h0 == 0 else h)
    for n in LAYERS:
        if isinstance(getattr(config, n, None), int):
            put(n, cfg.layers)
    for n in FFN + EXPERT_FFN:
        if hasattr(config, n) and not isinstance(getattr(config, n), (bool, str, list)):
            put(n, cfg.ffn_dim)
    for n in FFN_RELATIVE:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0:
            put(n, max(1, round(v * cfg.ffn_dim / ffn0)) if ffn0 else cfg.ffn_dim)
    if fields.get("head_dim", 0) is None:  # None means d_model / n_heads, but some families' layers use it raw
        put("head_dim", head)
    for n in PER_HEAD:
        v = getattr(config, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and head0:
            scaled = max(1, round(v * head / head0))
            put(n, head if n == "head_dim" else (max(2, scaled - scaled % 2) if n in EVEN else scaled))
    for n in PER_WIDTH:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0 and d0:
            put(n, max(1, round(v * d / d0)))
    for n, v in config.to_dict().items():
        if isinstance(v, float) and "layerdrop" in n:
            # the model skipping whole layers at random in training (m2m_100's 0.05): the layer under test would
            # sometimes not run at all; a regulariser of the stack, not of the layer
            put(n, 0.0)
        elif isinstance(v, float) and any(w in n for w in DROPOUT_WORDS) and "classifier" not in n:
            put(n, cfg.dropout)
    return out
