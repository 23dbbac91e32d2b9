"""Autograd graphs: walking one, and what the tensors a block keeps hang on it from one training step to the next."""

from __future__ import annotations

import torch.nn as nn

from tblock_cli.probes import held_tensors

# Nodes walked up a held tensor's graph (looking for the input, or the step before's); a block's graph has a few hundred.
GRAPH_WALK_MAX = 20000


def graph_nodes(grad_fn, limit: int | None = None):
    """The nodes of an autograd graph, each once, from grad_fn down (at most `limit`). Every node walked is held until
    the walk ends: some torch versions (2.11) hand out a new Python wrapper for a node on each `next_functions` read
    and free it with the last reference, so an id() of a dropped wrapper names the next node read, and a walk keyed
    by id() alone stops after a few nodes."""
    held: dict[int, object] = {}
    todo = [grad_fn]
    while todo and (limit is None or len(held) < limit):
        node = todo.pop()
        if node is None or id(node) in held:
            continue
        held[id(node)] = node
        yield node
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))


def reaches(grad_fn, inputs: set[int], limit: int = GRAPH_WALK_MAX, truncated: bool = False) -> bool:
    """Whether a graph leads back to one of the inputs (a weight recomputed from parameters, as the old weight_norm
    keeps it, does not: that is per-step state by design, not a graph of the data); `truncated` where the walk stops at
    `limit` nodes without finding one (too large to tell)."""
    nodes = 0
    for node in graph_nodes(grad_fn, limit):
        nodes += 1
        if id(getattr(node, "variable", None)) in inputs:
            return True
    return truncated and nodes >= limit


def kept_graphs(module: nn.Module) -> list:
    """The autograd node of each tensor the block keeps with one (probes.held_tensors): a step's graph hangs from it."""
    return [t.grad_fn for _, t in held_tensors(module)]


def carried_graphs(module: nn.Module, before: list) -> list[str]:
    """The tensors the block keeps after a training step, new since `before` (kept_graphs after the step before),
    whose autograd graph reaches a node kept then: each step's graph joined to the previous one's (a loss summed into
    an attribute, a state carried without detach)."""
    old = {id(node): node for node in before}
    carried = []
    for name, t in held_tensors(module):
        if old.get(id(t.grad_fn)) is t.grad_fn:
            continue  # the very tensor kept before: no new graph
        if any(old.get(id(n)) is n for n in graph_nodes(t.grad_fn, GRAPH_WALK_MAX)):
            carried.append(name)
    return list(dict.fromkeys(carried))
