"""Provenance markers: the entries of a tensor's provenance that are not projections (a norm's restart, attention's steps)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Marker:
    """An entry of a provenance beside the projections' names: what else a tensor came through."""


@dataclass(frozen=True)
class Norm(Marker):
    """The residual stream as a full-width norm left it: provenance starts again."""


@dataclass(frozen=True)
class Product(Marker):
    """The index-th product of two activations: perhaps attention's q.k scores."""

    index: int


@dataclass(frozen=True)
class Probs(Marker):
    """Attention call `call`'s weights (a softmax over a product), before they meet the values."""

    call: int


@dataclass(frozen=True)
class Attn(Marker):
    """Attention call `call`'s output."""

    call: int


NORM = Norm()
