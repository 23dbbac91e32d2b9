"""The modules whose options tblock reads or forces: nn.MultiheadAttention calls and eps-bearing norms.

Roles (which projections are attention, FFN, norms) come from the dataflow, in `dataflow.py`.
"""

from __future__ import annotations

import inspect

import torch.nn as nn


def attention_modules(module: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]


def norm_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that normalise with an `eps` floor: LayerNorm, RMSNorm and look-alikes by class name."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "eps", None), (int, float))
    ]


def mha_call_arguments(mha: nn.MultiheadAttention, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """How an nn.MultiheadAttention was called, defaults filled in (need_weights=True when not passed)."""
    bound = inspect.signature(mha.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def attention_weights_bytes(mha: nn.MultiheadAttention, bound: inspect.BoundArguments) -> int:
    """Bytes of the attention weights one call returns: (B, L, S), or (B, H, L, S) unaveraged."""
    q, k = bound.arguments["query"], bound.arguments["key"]
    batched = q.dim() == 3
    B = (q.shape[0] if mha.batch_first else q.shape[1]) if batched else 1
    L = q.shape[-2] if (mha.batch_first or not batched) else q.shape[0]
    S = k.shape[-2] if (mha.batch_first or not batched) else k.shape[0]
    heads = 1 if bound.arguments["average_attn_weights"] else mha.num_heads
    return B * heads * L * S * q.element_size()
