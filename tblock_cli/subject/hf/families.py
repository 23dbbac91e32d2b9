"""What tblock knows about particular families: config fields tied to the layer count or the head size, layers that
are not one module each, and rules a family breaks on purpose (the checks read `by_design`)."""

from __future__ import annotations

import math
import re

import torch.nn as nn

from tblock_cli.config import BlockConfig
from tblock_cli.errors import LoadError

# Families whose attention scores are unscaled by design (their init folds 1/sqrt(d_head) into q).
UNSCALED = {t: f"unscaled by design of {t}: its init folds 1/sqrt(d_head) into the query weights"
            for t in ("t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop", "pix2struct")}
UNSCALED["gpt_neo"] = "unscaled by design of gpt_neo: it computes q.k with no 1/sqrt(d_head) (as trained)"
# ALiBi families: bloom scales q.k inside baddbmm(alibi, q, k^T, alpha=1/sqrt(d_head)), where the trace does not see
# the factor; both add per-head linear biases whose spread, not a missing scale, sets the logit std.
UNSCALED["bloom"] = "scaled by design of bloom inside baddbmm(alibi, q, k^T, alpha=1/sqrt(d_head)), plus ALiBi biases"
UNSCALED["mpt"] = "by design of mpt: ALiBi biases added to the scaled scores set their spread"
UNSCALED["funnel"] = ("by design of funnel: relative-position and token-type scores added to the scaled content "
                      "scores set their spread at init")
# Granite and its MoE variants scale scores by attention_multiplier = 1/d_head (muP); their checkpoints set it
# (granite-3.0-8b: 0.0078125 at d_head 128); AutoConfig's default 1.0 would leave the scores unscaled. Newer types with
# the field (granite_swa, granite_docling_text, hyperclovax) are read from it (_multiplier).
MUP = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")
# MiniMax adds its residual after the input norm (hidden = LN(x); x = alpha * hidden + beta * attn(hidden)).
AFTER_NORM = {"minimax": "by design of minimax: its residual is taken after the input norm, scaled by the "
                         "layernorm_*_alpha factors"}
# Norms on each sublayer's output before the residual add: the stream itself is never normalised.
SUBLAYER_NORMED = {t: f"by design of {t}: its norms sit on each sublayer's output before the residual add; the "
                      f"residual stream itself is not normalised" for t in ("olmo2", "olmo3", "exaone4", "flex_olmo")}
# Layers that mix tokens without softmax attention: state-space and linear-attention mixers.
MIXER = re.compile(r"mamba|ssm|mixer|delta_?net|delta_?attention|linearattention|lightning|rwkv|retention|hyena|rglru", re.I)
# Speech encoders with a convolution module beside attention and FFN (Conformer's), or gated relative positions (WavLM's).
CONFORMER = ("wav2vec2-conformer", "wav2vec2-bert", "wavlm")
# Parameters that act only on inputs a layer driven on tokens alone does not get: rule -> why, per family.
CONDITIONAL_INPUTS = {"luke": "its entity-aware query projections (w2e, e2w, e2e) act only on entity tokens",
                      "blip_text_model": "its text layers' cross-attention reads image features",
                      "evolla": "its layers' adapter (a sequence aligner) cross-attends to protein, structure and MSA "
                                "features"}
# Sparse attention's key selectors (DeepSeek-V3.2's lightning indexer and its successors'): relu(q.k) scores, weighted
# over heads, ranked by top-k.
INDEXER = re.compile(r"indexer", re.I)
# Families whose layers cannot be driven one module at a time, and why.
REFUSED = {
    "xlm": "xlm keeps its layers as parallel lists (attentions, ffns, norms), not one module per layer",
    "flaubert": "flaubert keeps its layers as parallel lists (attentions, ffns, norms), not one module per layer",
    **{t: f"{t} pads the sequence to a multiple of its attention window before its layers run"
       for t in ("led", "longformer")},
    **{t: f"{t} merges patches between stages: its layers take a 2-D grid and change the sequence length"
       for t in ("swin", "swinv2", "donut-swin", "maskformer-swin")},
}


def family_overrides(model_type: str, config, cfg: BlockConfig, extra: dict) -> dict:
    """Config fields whose right value depends on the layer count or head size in a family-specific way."""
    if model_type in REFUSED:
        raise LoadError(f"--block hf:{model_type}: not driven: {REFUSED[model_type]}")
    out = {}
    if model_type == "gpt_neo" and "attention_types" not in extra:  # its alternation, cut to the layer count
        out["attention_layers"] = [["global", "local"][i % 2] for i in range(cfg.layers)]
        out["attention_types"] = [[[t], 1] for t in config.attention_layers[: cfg.layers]] if cfg.layers <= len(
            config.attention_layers) else [[["global", "local"], (cfg.layers + 1) // 2]]
        if cfg.layers % 2 and cfg.layers > len(config.attention_layers):
            raise LoadError(f"--block hf:gpt_neo: --layers {cfg.layers} must be even beyond {len(config.attention_layers)}")
    if model_type == "deepseek_v2" and config.num_experts_per_tok is None and "num_experts_per_tok" not in extra:
        out["num_experts_per_tok"] = 6  # AutoConfig leaves it None, which the router cannot take; DeepSeek-V2's value
    if model_type == "mamba2" and "head_dim" not in extra:  # its heads split the expanded width, not d_model
        out["head_dim"] = config.expand * cfg.d_model // cfg.n_heads
        if "n_groups" not in extra:  # groups of heads sharing B and C must divide the heads
            out["n_groups"] = math.gcd(config.n_groups, cfg.n_heads)
    if model_type == "funnel" and "block_sizes" not in extra:  # one block: no pooling between blocks
        out.update(block_sizes=[cfg.layers], block_repeats=[1], num_decoder_layers=0)  # its upsampling decoder: not run
    if "attention_multiplier" not in extra and (scale := _multiplier(model_type, config)) is not None:
        out["attention_multiplier"] = cfg.head_dim ** -scale
    n0 = next((getattr(config, n) for n in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(getattr(config, n, None), int)), 0)
    for name, pattern in config.to_dict().items():
        if name.endswith("layer_types") and isinstance(pattern, list) and pattern and name not in extra or (
                isinstance(pattern, list) and n0 > 1 and len(pattern) == n0 and name not in extra and name not in out):
            # per-layer lists (sliding / full, attention / mamba, dense / MoE): the checkpoint's pattern, cut or
            # repeated to the layer count
            out[name] = [pattern[i % len(pattern)] for i in range(cfg.layers)]
    return out


def _multiplier(model_type: str, config) -> float | None:
    """The power p of a score multiplier d_head^-p that the config's default attention_multiplier stands for: 1 for
    muP's 1/d_head (Granite's families; AutoConfig's placeholder 1.0 stands for it too), 0.5 for 1/sqrt(d_head) computed
    at the default head size (HyperCLOVA X). None for no such field, or a value that is neither."""
    m = getattr(config, "attention_multiplier", None)
    if not isinstance(m, (int, float)) or isinstance(m, bool):
        return None
    heads = getattr(config, "num_attention_heads", None)
    hd = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None)
    if model_type in MUP or m == 1.0 or (hd and math.isclose(m, 1 / hd)):
        return 1.0
    return 0.5 if hd and math.isclose(m, hd ** -0.5) else None


def _yarn_temperature(config) -> float | None:
    """mscale^2 where YaRN's mscale_all_dim folds into the softmax scale (transformers' yarn_apply_mscale, used by the
    MLA families: deepseek_v3 with YaRN, mistral4): 0.1 mscale_all_dim ln(factor) + 1, squared. None elsewhere."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) == "default":
        return None
    m, factor = rope.get("mscale_all_dim") or 0, rope.get("factor") or 1
    return (0.1 * m * math.log(factor) + 1) ** 2 if m and factor > 1 else None


def family_rules(module: nn.Module) -> dict[str, str]:
    """The rules a family breaks by design (`hf:` layers' `by_design`) for a block of the user's that keeps a config
    naming that family (`model_type`, as transformers' configs do: a T5 port holding a T5Config computes unscaled
    scores as T5 does); none where its configs name no family or several."""
    types, config = set(), None
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, (nn.Module, type, str, int, float, bool)) or v is None:
                continue
            try:
                kind = getattr(v, "model_type", None)
            except Exception:  # noqa: BLE001 - an attribute whose lookup raises names no family
                continue
            if isinstance(kind, str) and kind:
                types.add(kind)
                config = v
    return by_design(types.pop(), module, config) if len(types) == 1 else {}


def by_design(model_type: str, layers: nn.Module, config=None) -> dict[str, str]:
    """Rules of tblock's checks this family breaks on purpose, with the reason: rule -> sentence."""
    rules = {}
    if model_type in UNSCALED:
        rules["attention.unscaled"] = UNSCALED[model_type]
    if model_type in MUP or (config is not None and _multiplier(model_type, config) == 1.0):
        rules["attention.overscaled"] = (f"by design of {model_type}: scores scaled by attention_multiplier = 1/d_head "
                                         f"(muP), as its checkpoints set it")
    if model_type in AFTER_NORM:
        rules["residual.after_norm"] = AFTER_NORM[model_type]
    if model_type in SUBLAYER_NORMED:
        rules["norm_placement.ffn_unnormed"] = rules["norm_placement.attention_unnormed"] = SUBLAYER_NORMED[model_type]
    if model_type == "modernbert":
        rules["norm_placement.attention_unnormed"] = ("by design of modernbert: its first layer has no attention norm; the "
                                            "embeddings' final norm precedes it")
    mixers = sorted({type(m).__name__ for m in layers.modules() if MIXER.search(type(m).__name__)})
    if mixers:
        names = ", ".join(mixers[:3])
        rules["attention.no_softmax"] = f"by design of {model_type}: {names} mix tokens without softmax (state-space or linear attention)"
        rules["norm_placement.ffn_unnormed"] = (f"by design of {model_type}: the projections read as an FFN before any norm are inside "
                                      f"{names}, which reads the normalised stream through its input projection")
        rules["ffn_share.other"] = f"sit in {names} (by design of {model_type}: neither attention nor FFN)"
        rules["kv_cache.skip"] = (f"{model_type} mixes tokens with {names}: a recurrent state that generate advances one "
                                  f"token at a time, not a key/value cache; cached decoding not compared")
    if config is not None and (temperature := _yarn_temperature(config)) is not None:
        rules["attention.unscaled"] = (f"by design of {model_type}'s YaRN scaling: its softmax scale carries mscale^2 = "
                                       f"{temperature:.3g} (mscale_all_dim), as the reference MLA implementation does")
    indexers = sorted({type(m).__name__ for m in layers.modules() if INDEXER.search(type(m).__name__)})
    if indexers:
        names = ", ".join(indexers[:3])
        why = (f"by design of {model_type}: {names} (sparse attention's indexer) choose the keys each query reads "
               f"through top-k indices, which carry no gradient; the indexer trains on a loss of its own")
        rules["grad_params.missing"] = rules["train_eval.eval_unused"] = why
        rules["attention.no_softmax"] = (f"by design of {model_type}: {names} weigh relu(q.k) scores over heads to rank "
                                         f"keys, not to mix values")
    if model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        rules["relative.gains_inside"] = (f"by design of {model_type}: its query and key layernorms act after the rotary "
                                          f"embedding, as its checkpoints were trained")
    if model_type in CONDITIONAL_INPUTS:
        why = f"by design of {model_type}: {CONDITIONAL_INPUTS[model_type]}, which a layer driven on tokens alone does not get"
        rules["grad_params.missing"] = rules["train_eval.eval_unused"] = rules["ffn_share.other"] = why
    if model_type == "mobilebert":
        rules["ffn_share.linear"] = ("by design of mobilebert: its bottleneck (a linear map, then NoNorm's per-channel "
                                     "affine) feeds the stacked FFNs' first projections, so those compose linearly")
    if model_type == "vjepa2":
        why = ("by design of vjepa2: its rotary positions are 3-D (frame, height, width) over the patch grid, so scores "
               "are not a function of the 1-D index difference i - j, and token order matters")
        rules["relative.not_toeplitz"] = rules["order.scrambled"] = why
    if model_type in CONFORMER:
        rules["ffn_share.other"] = (f"sit in {model_type}'s convolution module (depthwise convolution over time, its "
                                    f"norm and pointwise projections) or relative-position parameters, by design")
        rules["batch.leak_train"] = (f"by design of {model_type}: its convolution module's BatchNorm normalises over the "
                                     f"batch in training")
    if model_type == "fnet":
        rules["order.scrambled"] = ("by design of fnet: its tokens mix through a Fourier transform over the sequence, "
                                    "whose output depends on each token's position")
        rules["residual.missing"] = ("by design of fnet: the Fourier transform sums every token and channel, so at init "
                                     "its output dwarfs the input, and the norm after the add (Post-LN) reads it alone")
    if model_type == "phimoe":
        rules["train_eval.skip"] = ("phimoe's router (sparsemixer) takes another path in training by design "
                                    "(training=self.training): train and eval are different functions")
        rules["derivative.wrong"] = ("by design of phimoe: its router (sparsemixer) trains with a gradient estimator, "
                                     "not the routing's derivative")
    if model_type == "bloom":
        rules["precision.differs"] = ("by design of bloom: its ALiBi biases (slope x distance, hundreds at 768 tokens) are "
                                      "added to scores in the run's dtype, where bfloat16 keeps steps of 2 to 4: far "
                                      "positions blur in bfloat16")
    if model_type == "funnel":
        rules["ffn_share.other"] = ("sit in funnel's relative-position and token-type attention parameters (r_kernel, "
                                    "r_*_bias, seg_embed), by design")
        cls = "funnel treats position 0 as its [CLS] token (separate_cls, its own token-type scores)"
        rules["padding.differs_alone"] = f"by design of funnel: {cls}, so left padding moves that role onto a pad"
        rules["relative.not_toeplitz"] = f"by design of funnel: {cls}, so its scores are not a function of i - j alone"
        rules["position_bias.skip"] = ("funnel adds relative-position and token-type terms inside its own attention kernel "
                                       "(rel_shift), not as one additive bias on q.k: the bias probe does not apply")
    if model_type == "nemotron":
        rules["norms.offset_init"] = ("by design of nemotron's transformers init: LayerNorm1P computes (1 + w) but is "
                                      "initialised like a plain LayerNorm (w = 1), so at random init it doubles its input; "
                                      "checkpoints carry trained w")
    if model_type == "convbert":
        why = "convbert's span-based convolution reads neighbouring positions"
        rules["padding.skip"] = f"{why}, padded ones included (its model does not mask them): padding reaches real outputs by design"
        rules["order.skip"] = f"{why}: token order matters by design"
        rules["ffn_share.other"] = "sit in convbert's span-based convolution (neither attention nor FFN), by design"
    if model_type == "nystromformer":
        why = "nystromformer's landmarks are means of consecutive segments of every position"
        rules["padding.skip"] = f"{why}, padded ones included: padding reaches real outputs by design"
        rules["order.skip"] = f"{why}: token order matters by design"
    if model_type == "xglm":
        rules["dtype.skip"] = ("xglm cannot run in float64: its attention fills a mask with torch.full((), "
                               "finfo(float64).min), which overflows when cast (a transformers bug)")
    return rules


def find_layers(model_type: str, stack: nn.Module, n: int) -> tuple[str, nn.ModuleList]:
    """The list of n layer modules inside stack: one module per layer, named like layers (xlm's first list of
    length n is its attentions)."""
    found = []
    for name, m in stack.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) != n or not len(m):
            continue
        kinds = {type(x).__name__ for x in m}
        if len(kinds) > 2 or any(isinstance(x, nn.ModuleList) for x in m):
            continue
        kind = next(iter(kinds)).lower()
        if re.search(r"attention|norm|mlp|ffn|feedforward|embedding|linear", kind) and not re.search(r"layer|block", kind):
            continue
        named = bool(re.search(r"(^|\.)(layers?|h|blocks?|layer_list)$", name))
        found.append((not named, name.count("."), name, m))
    if not found:
        raise LoadError(f"--block hf:{model_type}: found no list of {n} layer modules in {type(stack).__name__}")
    _, _, name, m = min(found, key=lambda f: f[:3])
    return name, m
