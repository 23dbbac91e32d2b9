"""Causal decoding with a KV cache: the `decode(x_t, cache) -> (y_t, cache)` protocol, driven and measured.

A block opts in by having that method: `x_t` is (B, n, d), one chunk of n >= 1 new tokens (a prompt is
one chunk: prefill); `cache` is None at the start and whatever the block returned after that.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.subject import first_tensor


def has_decode(module: nn.Module) -> bool:
    """A decode method, which a layer driven through its model has only where the model keeps a cache tblock can
    follow (`decodes` False otherwise)."""
    return callable(getattr(module, "decode", None)) and getattr(module, "decodes", True) is not False


def no_decode(module: nn.Module) -> str:
    """Why a block cannot be decoded, in words after its name."""
    if callable(getattr(module, "decode", None)):  # a driven model's layer whose model keeps no cache tblock follows
        from tblock_cli.subject.caches import RECOGNISED

        return f"is a layer of a model that keeps no KV cache by a convention tblock follows ({RECOGNISED})"
    return "has no decode(x_t, cache) -> (y_t, cache) method (see docs/decoding.md)"


def decode_step(module: nn.Module, x: torch.Tensor, cache):
    """One call of the protocol; the output may be a tensor or a tuple starting with one."""
    out = module.decode(x, cache)
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("decode(x_t, cache) must return (y_t, cache)")
    return first_tensor(out[0]), out[1]


def decode_chunks(module: nn.Module, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, object]:
    """Feed x (B, T, d) chunk by chunk (sizes sum to T); the outputs concatenated along T, and the last cache."""
    return decode_in_turns(module, [(x, sizes)])[0]


def decode_in_turns(module: nn.Module, runs: list[tuple[torch.Tensor, list[int]]]) -> list[tuple[torch.Tensor, object]]:
    """Several sequences decoded in turns, as a server interleaves requests: a chunk of each in a row, each sequence
    with its own cache. Per sequence (x (B, T, d), chunk sizes summing to T): its outputs concatenated along T, and
    its last cache."""
    for x, sizes in runs:
        assert sum(sizes) == x.shape[1], (sizes, x.shape)
    outs: list[list[torch.Tensor]] = [[] for _ in runs]
    caches: list = [None] * len(runs)
    starts = [0] * len(runs)
    for step in range(max(len(sizes) for _, sizes in runs)):
        for i, (x, sizes) in enumerate(runs):
            if step < len(sizes):
                t, n = starts[i], sizes[step]
                y, caches[i] = decode_step(module, x[:, t : t + n], caches[i])
                outs[i].append(y)
                starts[i] = t + n
    return [(torch.cat(o, dim=1), c) for o, c in zip(outs, caches)]


def cache_tensors(cache, _seen=None) -> list[torch.Tensor]:
    """Every tensor a cache holds, whatever its structure: tuples, lists, dicts, or an object's attributes."""
    seen = _seen if _seen is not None else set()
    if id(cache) in seen or cache is None or isinstance(cache, (int, float, str, bool)):
        return []
    seen.add(id(cache))
    if isinstance(cache, torch.Tensor):
        return [cache]
    if isinstance(cache, dict):
        items = list(cache.values())
    elif isinstance(cache, (list, tuple)):
        items = list(cache)
    elif hasattr(cache, "__dict__"):
        items = list(vars(cache).values())
    else:
        return []
    return [t for item in items for t in cache_tensors(item, seen)]


def cache_bytes(cache) -> int:
    """Bytes of the distinct storages a cache holds (a view and its base count once); a model's own preallocated
    cache counts the positions filled (its handle's `held_bytes`)."""
    if isinstance(getattr(cache, "held_bytes", None), int):
        return cache.held_bytes
    storages = {}
    for t in cache_tensors(cache):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def analytic_cache_bytes(layers: int, batch: int, positions: int, d_kv: int, item: int) -> int:
    """2 (keys and values) x layers x batch x positions x d_kv x bytes per element."""
    return 2 * layers * batch * positions * d_kv * item
