"""nn.MultiheadAttention as tblock reads it: the modules, how they were called, and one call taken apart.

`MHACall` is the one decomposition of `F.multi_head_attention_forward` that the dataflow tracer (scores,
roles) and the bench breakdown (time per part) share: projections, heads, and the masks combined.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tblock_cli.anatomy.ops import causal_mask

# Scores below this are a mask (-inf, finfo.min, -1e9), not a logit.
MASKED_LOGIT = -1e4


def attention_modules(module: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]


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


@dataclass(frozen=True)
class MHACall:
    """One call of F.multi_head_attention_forward, by name: inputs (L, N, E) or (L, E), weights per projection, masks."""

    args: dict  # every argument of the call, defaults filled in

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "MHACall":
        bound = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return cls(dict(bound.arguments))

    def __getitem__(self, name: str):
        return self.args[name]

    @property
    def heads(self) -> int:
        return self.args["num_heads"]

    @property
    def embed_dim(self) -> int:
        return self.args["embed_dim_to_check"]

    @property
    def batched(self) -> bool:
        return self.args["query"].dim() == 3

    @property
    def plain(self) -> bool:
        """No rare option (bias_k, add_zero_attn, static keys): the call is projections, SDPA, out-projection."""
        a = self.args
        return a["bias_k"] is None and not a["add_zero_attn"] and a["static_k"] is None and a["static_v"] is None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        if a["use_separate_proj_weight"]:
            return a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
        return a["in_proj_weight"].chunk(3)

    def biases(self) -> tuple:
        b = self.args["in_proj_bias"]
        return tuple(b.chunk(3)) if b is not None else (None, None, None)

    def masks(self, N: int, L: int, S: int, device) -> list[torch.Tensor]:
        """The call's masks broadcastable to (N, H, L, S): bool (True = not allowed) or additive float."""
        a = self.args
        out = []
        am = a["attn_mask"]
        if a["is_causal"] and am is None:
            am = causal_mask(L, S, device)
        if am is not None:
            out.append((am.reshape(N, self.heads, L, S) if am.dim() == 3 else am.reshape(1, 1, L, S)).to(device))
        kpm = a["key_padding_mask"]
        if kpm is not None:
            out.append(kpm.reshape(N if self.batched else 1, 1, 1, S).to(device))
        return out

    def blocked(self, N: int, L: int, S: int, device) -> torch.Tensor | None:
        """Where no attention may go, as one bool mask: float masks count where they are below MASKED_LOGIT."""
        parts = [m if m.dtype == torch.bool else m.double() < MASKED_LOGIT for m in self.masks(N, L, S, device)]
        if not parts:
            return None
        out = parts[0]
        for m in parts[1:]:
            out = out | m
        return out

    def additive(self, N: int, L: int, S: int, device, dtype: torch.dtype) -> torch.Tensor | None:
        """The masks as one float mask added to the scores, as the call itself applies them."""
        out = None
        for m in self.masks(N, L, S, device):
            f = torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
            out = f if out is None else out + f
        return out
