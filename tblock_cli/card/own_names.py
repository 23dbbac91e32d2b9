"""The names a block may say what it is by, and the card entry each speaks for: config fields, constructor arguments
and module attributes (`card/own.py` reads them). Only names whose meaning is not in doubt are here."""

from __future__ import annotations

import math

# Not a card key: the rotating fraction of a head, turned into a rope.dims claim by `with_fraction`.
FRACTION = "rope.fraction"
# Not a card key either: the FFN's hidden width over the model's (timm's mlp_ratio), an ffn.hidden claim where the
# card reads an FFN that is not gated (a gated one's ratio may count gate and up together, OLMo's, or 2/3 of it, Meta's)
RATIO = "ffn.ratio"
# Not a card key: YaRN's attention factor, the gain its rotation puts on q and k (HF's `attention_factor`, by default
# 0.1 ln(factor) + 1), turned into an attn.scale claim by `with_yarn_gain` once the card has read the head's width
YARN_GAIN = "rope.yarn_gain"
# Not a card key: DeepSeek's YaRN softmax gain (HF's yarn_apply_mscale: the score scale times mscale(factor,
# mscale_all_dim)^2 over every channel, rotating or not), turned into an attn.scale claim by `with_softmax_gain`
SOFTMAX_GAIN = "attn.softmax_gain"
# the families whose transformers code applies it (yarn_apply_mscale); Ministral 3 keeps mscale_all_dim in its yarn
# dict and scales only its rotary table by it
MSCALE_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                   "minicpm3", "mistral4", "mistral_large4", "youtu", "axk1", "axk2", "bailing_hybrid", "hy_v4",
                   "hy_v4_vl")
# Not card keys either: LongRoPE's per-pair divisors ((short factors), (long factors) or None, the original length or
# None), turned into a rope.freqs claim by `with_longrope` beside the claimed theta; and a dynamic NTK scaling's original
# length (0 unknown), which says the base is theta's only at probes no longer than that (`with_dynamic`)
LONGROPE = "rope.longrope"
DYNAMIC = "rope.dynamic"
# Not a card key: the family a config names (transformers' `model_type`), which says which way its checkpoints
# rotate (`with_direction`): every rotary family forward but those listed, whose checkpoints were trained with each
# pair turned the other way (transformers' NanoChat: rotate_half as cat(x2, -x1), as Karpathy's nanochat and
# modded-nanogpt write it)
FAMILY = "family"
BACKWARD_ROTATION = ("nanochat",)
# Not card keys: T5's relative-position buckets (their count, the distance the last one starts at, and whether the
# buckets look one way only, a decoder's), turned into a relbias.steps claim by `with_buckets`
RELBUCKETS, RELMAX, RELONEWAY = "relbias.buckets", "relbias.max_distance", "relbias.one_way"
# Not a card key: `norm_topk_prob=False`, which claims no renormalisation only beside a family whose transformers code
# reads it (`with_renorm_off`): litgpt keeps it False for every model while its MoE renormalises
RENORM_OFF = "moe.renorm_off"
RENORM_FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "doge", "kolibri1", "kolibri1_1", "qwen3_next",
                   "qwen3_omni_moe", "deepseek_v3", "glm4_moe", "dots1", "exaone_moe", "minicpm5_moe", "kimi_linear")
# Families whose transformers code weights each token's chosen experts by a softmax of the router's outputs (over all
# experts, renormalised over the chosen or not, or over the chosen logits), with no field saying so: their model_type
# claims moe.router softmax (each read so from its own layer: `tblock spec --block hf:TYPE`). Not Phi-MoE's
# sparsemixer, nor the sigmoid routers (Llama 4's, GLM-4.5's, DeepSeek-V3's, which says so in `scoring_func`). Held in
# FAMILY_IMPLIED below, as every key a family implies
SOFTMAX_ROUTERS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "granitemoe", "minimax", "jetmoe",
                   "gpt_oss")
# Families whose transformers code gates the shared expert's output by a sigmoid of a one-output linear
# (`shared_expert_gate`): beside a shared expert they claim moe.shared_gate sigmoid (DeepSeek's, GLM's and Llama 4's
# shared experts are added ungated)
SIGMOID_SHARED_GATES = ("qwen2_moe", "qwen3_5_moe", "qwen3_next", "qwen3_omni_moe", "qwen4_exp")
# What a family's transformers code computes in every layer with no config field saying it, claimed by its
# `model_type` where nothing else claims the key (each read so on its own layer, `tblock spec --block hf:TYPE`):
# Qwen3's and OLMo 2's norms on q and k (per head, over the whole projection), OLMo 2's norms after each sublayer,
# Gemma's (1 + w) RMSNorm and Gemma 2's and 3's norms on both sides of each sublayer, Cohere's parallel sublayers,
# EXAONE 4's, Apertus's and Doge's per-head q/k norms, GLM-4's sandwich, Nemotron's LayerNorm1P, Qwen2's and Phi's
# biases, GPT-J's, CodeGen's and Phi's parallel sublayers
FAMILY_IMPLIED = {
    "qwen3": {"attn.qk_norm": "head"}, "qwen3_moe": {"attn.qk_norm": "head"},
    "olmo2": {"attn.qk_norm": "width", "norm.placement": "olmo2"}, "olmo3": {"attn.qk_norm": "width", "norm.placement": "olmo2"},
    "gemma": {"norm.offset": True}, "vaultgemma": {"norm.offset": True},
    "gemma2": {"norm.offset": True, "norm.placement": "sandwich"},
    "gemma3_text": {"norm.offset": True, "norm.placement": "sandwich", "attn.qk_norm": "head"},
    "cohere": {"residual.form": "parallel"}, "cohere2": {"residual.form": "parallel"},
    "exaone4": {"attn.qk_norm": "head", "norm.placement": "olmo2"}, "apertus": {"attn.qk_norm": "head"},
    "doge": {"attn.qk_norm": "head"}, "glm4": {"norm.placement": "sandwich"}, "nemotron": {"norm.offset": True},
    # biases no config field switches: Qwen2's q, k and v projections (o and the MLP without), Phi's every projection
    # (GPT-2's Conv1D and BLOOM's linears always add one, T5's, Mixtral's and Phi-3's never, GPT-J's and CodeGen's in
    # the FFN only) ...
    "qwen2": {"bias.qkv": True, "bias.ffn": False}, "gpt2": {"bias.qkv": True, "bias.ffn": True},
    "bloom": {"bias.qkv": True, "bias.ffn": True}, "t5": {"bias.qkv": False, "bias.ffn": False},
    "mixtral": {"bias.qkv": False, "bias.ffn": False}, "phi3": {"bias.qkv": False, "bias.ffn": False},
    # ... and GPT-J's, CodeGen's and Phi's (phi-1, phi-2) parallel sublayers: attention and FFN read one norm of the
    # stream, added together (GPT-NeoX's and Falcon's say so in a field)
    "phi": {"bias.qkv": True, "bias.ffn": True, "residual.form": "parallel"},
    "gptj": {"bias.qkv": False, "bias.ffn": True, "residual.form": "parallel"},
    "codegen": {"bias.qkv": False, "bias.ffn": True, "residual.form": "parallel"},
}
# ... and whether the FFN is gated (act(gate) * up, Llama's; an act between two projections, GPT-2's), each read so
FFN_GATED = {**dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
                              "olmo2", "cohere", "granite"), True),
             **dict.fromkeys(("gpt2", "gpt_neox", "phi", "falcon", "bloom", "opt", "starcoder2", "gptj"), False)}
# ... and which norm it is (an RMSNorm, or a LayerNorm that subtracts the mean: Cohere's without a bias, OLMo's
# without parameters), each read so
NORM_KIND = {**dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                              "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"), "rmsnorm"),
             **dict.fromkeys(("olmo", "cohere", "gpt2", "gpt_neox", "phi", "falcon", "bloom", "opt", "starcoder2",
                              "gptj"), "layernorm")}
# ... and how its checkpoints pair the rotating channels in the projections' outputs (transformers' rotate_half: i with
# i + dims/2, the q/k weights permuted from Meta's interleaved layout at conversion; Cohere's and GPT-J's 2i with
# 2i + 1), each read so: a port holding the family's config reads its checkpoints as they are
ROPE_PAIRING = {**dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo",
                                 "olmo2", "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_neox", "phi",
                                 "stablelm", "falcon", "starcoder2"), "half"),
                **dict.fromkeys(("cohere", "cohere2", "gptj"), "interleaved")}
FAMILY_IMPLIED = {f: {**FAMILY_IMPLIED.get(f, {}), **({"ffn.gated": FFN_GATED[f]} if f in FFN_GATED else {}),
                      **({"norm.kind": NORM_KIND[f]} if f in NORM_KIND else {}),
                      **({"rope.pairing": ROPE_PAIRING[f]} if f in ROPE_PAIRING else {}),
                      **({"moe.router": "softmax"} if f in SOFTMAX_ROUTERS else {})}
                  for f in FAMILY_IMPLIED.keys() | FFN_GATED.keys() | NORM_KIND.keys() | ROPE_PAIRING.keys()
                  | set(SOFTMAX_ROUTERS)}
# Fields that size a partial rotation and, in every transformers family that keeps one, rotate the head's first
# channels (q[..., :rotary_dim]): they claim rope.place first as well (not multi-head latent attention's
# qk_rope_head_dim, whose rope part comes last)
PLACED_FIRST = ("partial_rotary_factor", "rotary_pct", "rotary_percentage", "rotary_dim", "rotary_ndims",
                "rotary_emb_dim")
# Not card keys: DeepSeek's group-limited routing (the experts in n_group groups, each token's top-k among its
# topk_group best groups, unless its topk_method is "greedy"), turned into a moe.groups claim by `with_groups`
NGROUP, TOPKGROUP, TOPKMETHOD = "moe.n_group", "moe.topk_group", "moe.topk_method"
# attribute or config field -> card key, read on any module or config.
FIELDS = {
    "rope_theta": "rope.theta", "rope_base": "rope.theta", "rotary_base": "rope.theta", "rotary_emb_base": "rope.theta",
    "rope_freq_base": "rope.theta",
    "rotary_dim": "rope.dims", "rotary_ndims": "rope.dims", "rope_dim": "rope.dims", "qk_rope_head_dim": "rope.dims",
    "attn_logit_softcapping": "attn.softcap", "logit_softcap": "attn.softcap", "logit_softcapping": "attn.softcap",
    "attn_softcap": "attn.softcap", "softcap": "attn.softcap", "attention_logit_softcapping": "attn.softcap",
    # OLMo's, DBRX's and MPT's clamp on the q, k and v projections' outputs (None: no clamp, and no claim)
    "clip_qkv": "attn.clip",
    # T5's (and mT5's, UMT5's, LongT5's) relative attention buckets; a decoder's look at earlier keys only
    "relative_attention_num_buckets": RELBUCKETS, "relative_attention_max_distance": RELMAX, "is_decoder": RELONEWAY,
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
    "act_layer": "ffn.act", "activation_func": "ffn.act",  # timm's and open_clip's class, Megatron's function
    "num_experts_per_tok": "moe.top_k", "moe_top_k": "moe.top_k", "n_activated_experts": "moe.top_k",
    "num_local_experts": "moe.experts", "n_routed_experts": "moe.experts", "num_experts": "moe.experts",
    "moe_num_experts": "moe.experts", "n_expert": "moe.experts", "n_expert_per_token": "moe.top_k",
    "norm_topk_prob": "moe.renorm", "scoring_func": "moe.router", "routed_scaling_factor": "moe.scale",
    "n_group": NGROUP, "topk_group": TOPKGROUP, "topk_method": TOPKMETHOD,
    # the same routing under other names (Aria's, Hunyuan's and LongCat's moe_topk, Ernie's moe_num_shared_experts,
    # Kimi's and Bailing's aliases, AFMoE's route_scale on the chosen weights)
    "moe_topk": "moe.top_k", "num_experts_per_token": "moe.top_k", "moe_num_shared_experts": "moe.shared",
    "num_expert_group": NGROUP, "moe_renormalize": "moe.renorm", "route_scale": "moe.scale",
    # T5's (and Pix2Struct's, CPM-Ant's) per-head width, T5's gated FFN switch and its activation; DINOv2's SwiGLU and
    # DINOv3's gated FFN switches; Gemma's bidirectional switch (True: no causal mask; False says nothing of the mask)
    "d_kv": "attn.head_dim", "dim_head": "attn.head_dim", "is_gated_act": "ffn.gated", "dense_act_fn": "ffn.act",
    "use_swiglu_ffn": "ffn.gated", "use_gated_mlp": "ffn.gated", "use_bidirectional_attention": "attn.causal",
    "rotary_embedding_base": "rope.theta",
    # litgpt's Config: its q/k norm switch, group-limited routing (DeepSeek-V3's) and shared experts
    "norm_qk": "attn.qk_norm", "n_expert_groups": NGROUP, "n_topk_groups": TOPKGROUP, "n_shared_expert": "moe.shared",
    # Megatron's TransformerConfig: the same group limit and the router's score function
    "moe_router_num_groups": NGROUP, "moe_router_group_topk": TOPKGROUP, "moe_router_score_function": "moe.router",
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
    # the same switch in OPT's config (OPT-350m's False: its layers are Post-LN); not a bare `pre_norm`, which
    # x-transformers keeps True beside its sandwich norms
    "do_layer_norm_before": "norm.placement",
    "rotary_emb_dim": "rope.dims",  # flash-attn's MHA: the rotating channels per head
    # Megatron's switch for a (1 + w) norm weight initialised at 0
    "layernorm_zero_centered_gamma": "norm.offset", "zero_centered_gamma": "norm.offset",
    # litgpt's (1 + w) RMSNorm switch, its GELU switch ("tanh" claims gelu_tanh, "none" nothing: its Llama MLPs never
    # read it); timm's FFN width over the model's
    "add_unit_offset": "norm.offset", "gelu_approximate": "ffn.act", "mlp_ratio": RATIO, "ffn_ratio": RATIO,
    "ff_mult": RATIO,
    # Megatron's TransformerConfig (and ChatGLM's kv_channels): head width, a gated FFN, the norm, the rotating
    # fraction, the routing; litgpt's norm_class_name and mlp_class_name (its gated MLPs LLaMAMLP and GemmaMLP, its
    # GptNeoxMLP not)
    "kv_channels": "attn.head_dim", "gated_linear_unit": "ffn.gated", "normalization": "norm.kind",
    "norm_class_name": "norm.kind", "mlp_class_name": "ffn.gated", "rotary_percent": FRACTION,
    "num_moe_experts": "moe.experts", "moe_router_topk": "moe.top_k", "moe_router_topk_scaling_factor": "moe.scale",
    # OLMo's ModelConfig: its activation, norm, qk-norm and bias switches
    "activation_type": "ffn.act", "layer_norm_type": "norm.kind", "attention_layer_norm": "attn.qk_norm",
    "norm_type": "norm.kind",  # MPT's (low_precision_layernorm), InternVL's vision layers' (layer_norm, rms_norm)
    "include_bias": "bias.any",  # litgpt's: "tanh" claims gelu_tanh, "none" nothing (its Llama MLPs never read it)
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
# MiniCPM's depth-scaled residual: each branch's output times scale_depth / sqrt(num_hidden_layers) at its add, read
# where a config (or a block's arguments, or a module's attributes) keeps both; this pseudo field holds the product
DEPTH_SCALED = "scale_depth / sqrt(num_hidden_layers)"
MULTIPLIERS[DEPTH_SCALED] = BRANCH_GAINS


def derived_fields(values: dict) -> dict:
    """values with what their fields say together: MiniCPM's branch gain scale_depth / sqrt(num_hidden_layers) beside
    them, where both are numbers; litgpt's rope_condense_ratio as the linear scaling it is; a LongRoPE or dynamic scaling dict given the lengths it takes from its config (Phi-3
    keeps `original_max_position_embeddings` and `max_position_embeddings` beside its rope_scaling, whose factor is
    their ratio)."""
    depth, layers = values.get("scale_depth"), values.get("num_hidden_layers")
    if positive(depth) and isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        values = {**values, DEPTH_SCALED: depth / layers ** 0.5}
    ratio = values.get("rope_condense_ratio")  # litgpt's positions divided by it: linear scaling by that factor
    if positive(ratio) and ratio != 1 and not any(isinstance(values.get(n), dict) for n in SCALINGS):
        values = {**values, "rope_scaling": {"type": "linear", "factor": ratio}}
    orig = values.get("original_max_position_embeddings")
    longest = values.get("max_position_embeddings")
    for name in SCALINGS:
        d = values.get(name)
        if not isinstance(d, dict) or d.get("rope_type", d.get("type")) not in LONGROPES + DYNAMICS:
            continue
        d = dict(d)
        if "original_max_position_embeddings" not in d and (positive(orig) or positive(longest)):
            d["original_max_position_embeddings"] = orig if positive(orig) else longest
        if d.get("factor") is None and positive(d.get("original_max_position_embeddings")) and positive(longest):
            d["factor"] = longest / d["original_max_position_embeddings"]
        values = {**values, name: d}
    return values


def positive(v) -> bool:
    """A number a config field may claim by: a finite int or float above 0 (a bool is a switch, not a number)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# LayerScale's start (CaiT, DeiT III, DINOv2, BEiT): each branch's per-channel gain at its add, as built. timm's
# `init_values` is read only as a block's constructor argument (the name is too plain elsewhere).
LAYER_SCALES = ("layer_scale_init_value", "layerscale_value", "layer_scale_init", "layerscale_init_value",
                "ls_init_value", "layer_scale_init_values", "layerscale_init")
MULTIPLIERS.update({n: BRANCH_GAINS for n in LAYER_SCALES})
# a switch beside it that turns LayerScale off (FocalNet's use_layerscale=False next to its layerscale_value 1e-4)
LAYER_SCALE_SWITCHES = ("use_layerscale", "use_layer_scale", "layerscale", "layer_scale")


def layer_scale_off(values: dict) -> dict:
    """values without their LayerScale start where a switch beside it is False."""
    if any(values.get(s) is False for s in LAYER_SCALE_SWITCHES):
        return {f: v for f, v in values.items() if f not in LAYER_SCALES and f != "init_values"}
    return values
# The card's words for a switch's True and False, for the keys a boolean field claims
SWITCHED = {"residual.form": ("parallel", "sequential"), "rope.pairing": ("interleaved", "half"),
            "attn.qk_norm": ("any", "none"), "norm.placement": ("pre", "post")}
# switches that, set True, claim pos.kind (False says nothing: a layer without positions of its own, NoPE's)
POSITION_SWITCHES = {"use_rotary": "rotary", "use_rope": "rotary", "use_alibi": "alibi", "alibi": "alibi",
                     "rope": "rotary"}
# OLMo's and Molmo2's placement switch: True normalises each sublayer's output before the add (OLMo 2's), False its
# input
NORM_AFTER = {"norm_after": ("olmo2", "pre")}
# a second rotary base for some layers (sliding-window ones): the config's base then speaks for the others only
LOCAL_BASES = ("rope_local_base_freq", "local_rope_theta", "rope_local_theta", "local_rope_base", "rope_local_base")
# the same switch the other way round: vLLM's is_neox_style (True: GPT-NeoX's half-split pairing)
HALF_SPLIT = ("is_neox_style",)
# Head counts, read together: a count of key/value heads (or of query heads per key/value head) beside a count of
# query heads claims attn.group, their ratio. The ratio, not the counts: a layer that splits each head in two
# (Differential Transformer's q1/q2, k1/k2) doubles both counts and keeps the ratio.
HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")  # the last XGLM's, Kosmos-2's
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_query_groups", "multi_query_group_num",
            "num_query_groups")
GROUPS = ("num_key_value_groups", "n_rep")
# gpt-fast's count of key/value heads (its ModelArgs' and its Attention's): not where the module also keeps
# `n_local_kv_heads`, as Meta's llama Attention does, whose `n_local_heads` counts one model-parallel rank's query heads
LOCAL_KV_HEADS, META_LOCAL = ("n_local_heads",), "n_local_kv_heads"
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
SCALINGS = ("rope_scaling", "rope_parameters", "rope_adjustments")  # the last litgpt's
SCALED = ("linear", "llama3", "yarn")
# LongRoPE (Phi-3's; "su" in its first configs): each pair's frequency divided by its own factor, the short ones up to
# the original length, and an attention factor on cos and sin; dynamic NTK: theta's table up to the original length
LONGROPES = ("longrope", "su")
DYNAMICS = ("dynamic",)
# a scaling dict that names no type (gpt-fast's rope_scaling, litgpt's rope_adjustments) is of the kind its keys are
# particular to; a factor alone names none (linear in litgpt, dynamic NTK in other code)
TYPED_BY_KEYS = {"llama3": {"low_freq_factor", "high_freq_factor"}, "yarn": {"beta_fast", "beta_slow"}}
# torchtune's Llama3ScaledRoPE (and Llama4ScaledRoPE) keep llama-3's scaling as attributes of the rotary module beside
# `scale_factor`: its rope_scaling dict's keys -> their attribute names
LLAMA3_BAND = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "original_max_position_embeddings": "old_context_len"}
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
# A config's per-layer attention kinds (transformers' `layer_types`) with the layer's own index (HF's `layer_idx`,
# Meta's and torchtitan's `layer_id`, 0-based): the kind of this layer says whether its window is the config's
# `sliding_window` or none, and which of a `rope_parameters` keyed by kind (Gemma-3's local and global bases) it rotates by
LAYER_TYPES = "layer_types"
LAYER_INDICES = ("layer_idx", "layer_id")
# GPT-2's score scale switches (ImageGPT's, GPT-BigCode's): `scale_attn_weights` False leaves q.k undivided, and
# `scale_attn_by_inverse_layer_idx` divides it by the layer's index + 1 as well (the card's attn.scale X of 1/sqrt(X)
# times (index + 1)^2), read at the layer's own index
UNSCALED, BY_LAYER = "scale_attn_weights", "scale_attn_by_inverse_layer_idx"

LAYER_WINDOWS = {"sliding_attention": "window", "full_attention": "none"}
# Llama 4's and SmolLM3's per-layer switch list, read at the layer's index the same way: 1 rotates, 0 is a NoPE layer
ROPE_LAYERS = "no_rope_layers"
# A window of None says the layer attends to every key (a Hugging Face attention module's own sliding_window on its
# full-attention layers), and so does a switch that turns sliding off for the whole model (Qwen2's
# use_sliding_window=False, whatever sliding_window it also keeps)
WINDOW_SWITCHES = ("use_sliding_window",)
# read only on a module whose class name says it is a relative position bias (T5RelativePositionBias, RelativePosition)
ON_RELATIVE = {"num_buckets": RELBUCKETS, "max_distance": RELMAX, "causal": RELONEWAY}
# read only on a norm module written outside torch (torch's own use the eps they keep, by construction)
ON_NORM = {"eps": "norm.eps", "variance_epsilon": "norm.eps"}
BIAS_ON = "<a bias switch on>"  # among the names seen: a generic bias switch's False claims nothing then
# norm class names as configs write them (Megatron's normalization, litgpt's norm_class_name) -> the card's
NORM_KINDS = {"rmsnorm": "rmsnorm", "layernorm": "layernorm", "rms": "rmsnorm",  # the last OLMo's layer_norm_type
              "rms_norm": "rmsnorm", "layer_norm": "layernorm", "low_precision_layernorm": "layernorm"}  # norm_type's
# class names that say what an FFN computes (a module of the block's own, or a library's: torch's do what they say by
# construction), lower-cased, letters and digits only, a trailing "activation" dropped, read by their start ->
# (ffn.gated, ffn.act) they claim (None: nothing; a tuple: any of them, GeGLU's gelu exact or tanh).
CLASS_ACTS = {"swiglu": (True, "silu"), "geglu": (True, ("gelu", "gelu_tanh")), "reglu": (True, "relu"), "relusquared": (None, "relu2"),
              "squaredrelu": (None, "relu2"), "relu2": (None, "relu2"), "quickgelu": (None, "quick_gelu"),
              "newgelu": (None, "gelu_tanh"), "gelutanh": (None, "gelu_tanh"), "pytorchgelutanh": (None, "gelu_tanh"),
              "fastgelu": (None, "gelu_tanh")}
# fields whose value may be an activation's class or function (timm's and open_clip's act_layer, Megatron's
# activation_func), read by `act_layer`; functions by their name
CALLABLE_ACTS = ("act_layer", "activation_func")
FUNCTION_ACTS = {"gelu": "gelu", "silu": "silu", "relu": "relu", "squared_relu": "relu2", "quick_gelu": "quick_gelu",
                 "erf_gelu": "gelu", "openai_gelu": "gelu_tanh", "fast_gelu": "gelu_tanh"}
# FFN class names that say whether it is gated (litgpt's mlp_class_name; its MoE classes say nothing)
GATED_MLPS = {"LLaMAMLP": True, "GemmaMLP": True, "GptNeoxMLP": False}
# activation names as configs write them -> the card's
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "gelu_tanh": "gelu_tanh", "silu": "silu", "swish": "silu", "relu": "relu", "quick_gelu": "quick_gelu",
        "relu2": "relu2", "relu_squared": "relu2", "swiglu": "silu", "geglu": "gelu", "gelu-approximate": "gelu_tanh"}
