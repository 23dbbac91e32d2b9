"""The sentence of every bench, depth and params finding, by kind, from its facts."""

from __future__ import annotations

MESSAGES: dict = {}
