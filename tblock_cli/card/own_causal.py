"""A block's own word that its queries ignore later keys (`causal=True` built with or kept, a `CausalSelfAttention`):
the `causal` check runs on a block that says so, as on one declared `--causal`."""

from __future__ import annotations

import torch.nn as nn

from tblock_cli.card.own import config_fields, fields_of, is_config

# A block's own word that its queries ignore later keys: a switch of one of these names set to True
CAUSAL_NAMES = ("causal", "is_causal")


def own_causal(modules: list[nn.Module], arguments: dict | None = None) -> str | None:
    """Where the block says it is causal, or None where it does not say so (or says two things). In order, the first
    tier that speaks decides: its constructor arguments and the configs among them (`causal=True`), its modules'
    attributes (`self.is_causal = True`), and last an attention module's class name (`CausalSelfAttention`). Only a
    True is a claim: a False may mean a mask the block builds another way."""
    def tier(found: dict) -> str | None:
        return found.get(True) if len(found) == 1 else None

    asked: dict = {}

    def fields(values: dict, where: str) -> None:
        for field, v, at in fields_of(values, where):
            if field in CAUSAL_NAMES and isinstance(v, bool):
                asked.setdefault(v, f"{at} `{field}={v}`")

    fields(arguments or {}, "constructor argument")
    for m in modules:
        for name, value in vars(m).items():
            if is_config(value):
                fields(config_fields(value), f"{type(m).__name__}.{name}'s")
    if asked:
        return tier(asked)
    kept = {}
    for m in modules:
        for name in CAUSAL_NAMES:
            value = vars(m).get(name)
            if isinstance(value, bool):
                kept.setdefault(value, f"`{type(m).__name__}.{name} = {value}`")
    if kept:
        return tier(kept)
    for m in modules:
        cls = type(m).__name__.lower()
        if ("attn" in cls or "attention" in cls) and "causal" in cls and not any(
                w in cls for w in ("noncausal", "non_causal", "acausal", "bicausal")):
            return f"class name `{type(m).__name__}`"
    return None
