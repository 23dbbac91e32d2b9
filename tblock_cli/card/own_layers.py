"""What a model's config says of one of its layers, read at the layer's own index: transformers' `layer_types` (the
layer's window, and with a `rope_parameters` keyed by kind its base and scaling), `no_rope_layers` (whether it
rotates) and GPT-2's `scale_attn_by_inverse_layer_idx` (its score scale). `with_layer_claims` puts these over card/own.py's claims, the config's generic ones, which speak for some
layers only."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from tblock_cli.card.entries import Claim
from tblock_cli.card.own import _count, is_config
from tblock_cli.card.own_names import (
    BY_LAYER,
    LAYER_INDICES,
    LAYER_TYPES,
    LAYER_WINDOWS,
    ROPE_LAYERS,
    UNSCALED,
    positive,
)
from tblock_cli.card.own_scaling import scaling as _scaling


def layer_claims(modules: list[nn.Module], arguments: dict) -> dict:
    """{key: (value, where)} for what a config's `layer_types` says of this layer, found by its index (a constructor
    argument or module attribute `layer_idx` or `layer_id`, one value): a sliding layer's window is the config's
    `sliding_window`, a full-attention layer's none; a `rope_parameters` keyed by the kinds (transformers 5's Gemma-3)
    gives the layer's base and scaling; Llama 4's and SmolLM3's `no_rope_layers` (1: this layer rotates, 0: NoPE)
    its positions; GPT-2's `scale_attn_by_inverse_layer_idx` True its score scale, q.k / sqrt(d_head) (or q.k, with
    `scale_attn_weights` False) divided by the index + 1. Empty where no index, several, or no config with `layer_types` is found."""
    def index(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    found = {v for k, v in arguments.items() if k in LAYER_INDICES and index(v)}
    found |= {v for m in modules for k, v in vars(m).items() if k in LAYER_INDICES and index(v)}
    configs = [v for v in arguments.values() if is_config(v)]
    configs += [v for m in modules for v in vars(m).values() if is_config(v)]
    if len(found) != 1 or not configs:
        return {}
    (idx,) = found
    out = {}
    for config in configs:
        fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
        if fields.get(BY_LAYER) is True:
            per, where = (idx + 1) ** 2, f"config's `{BY_LAYER}` at layer {idx} (q.k divided by {idx + 1})"
            head = _head_dim(fields)
            if fields.get(UNSCALED) is False:
                out["attn.scale"] = (float(per), where)
            elif head:
                out["attn.scale"] = (float(head * per), where)
        roped = fields.get(ROPE_LAYERS)
        if isinstance(roped, (list, tuple)) and 0 <= idx < len(roped) and roped[idx] in (0, 1):
            out["pos.kind"] = ("rotary" if roped[idx] else "none", f"config's `{ROPE_LAYERS}`[{idx}] ({roped[idx]})")
        kinds = fields.get(LAYER_TYPES)
        if not isinstance(kinds, (list, tuple)) or not 0 <= idx < len(kinds) or not isinstance(kinds[idx], str):
            continue
        kind, where = kinds[idx], f"config's `layer_types`[{idx}] ({kinds[idx]})"
        window = {"window": _count(fields.get("sliding_window")), "none": "none"}.get(LAYER_WINDOWS.get(kind, ""))
        if window is not None:
            out["attn.window"] = (window, where)
        rope = fields.get("rope_parameters")
        if isinstance(rope, dict) and isinstance(rope.get(kind), dict):
            theta = rope[kind].get("rope_theta")
            if positive(theta):
                out["rope.theta"] = (float(theta), where)
            out.update({k: (v, where) for k, v in _scaling(rope[kind]).items()})
    return out


def _head_dim(fields: dict) -> int | None:
    """A config's head width: its head_dim, or its width over its head count (GPT-2's n_embd / n_head)."""
    if isinstance(fields.get("head_dim"), int) and fields["head_dim"] > 0:
        return fields["head_dim"]
    for width, count in (("n_embd", "n_head"), ("hidden_size", "num_attention_heads")):
        w, n = fields.get(width), fields.get(count)
        if isinstance(w, int) and isinstance(n, int) and n > 0 and w % n == 0:
            return w // n
    return None


def with_layer_claims(claims: tuple[Claim, ...], modules: list[nn.Module], arguments: dict) -> tuple[Claim, ...]:
    """own_claims' claims with this layer's own (layer_claims) in place of any of the same key."""
    layered = layer_claims(modules, arguments)
    return tuple(c for c in claims if c.key not in layered) + tuple(
        Claim(key, value, f"the block's own {where}", tier="asked") for key, (value, where) in layered.items())
