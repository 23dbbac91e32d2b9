"""Small formatting helpers the message tables share (no torch, no Rich)."""

from __future__ import annotations


def shape(dims) -> str:
    return str(tuple(dims))


def names(items) -> str:
    return ", ".join(items)


def span(values, fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}"


def layer_prefix(layer) -> str:
    return "" if layer is None else f"layer {layer}: "
