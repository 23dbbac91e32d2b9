"""Blocks under torch.autocast, for the `precision` check: a mixture of experts that writes each expert's output into
a buffer made like the input by index (under autocast the experts compute in bfloat16, the buffer stays float32, and
the write raises), and the correct twin that casts before it writes."""

import torch
from zoo_training import MoEBlock


class IndexedExperts(MoEBlock):
    """MoEBlock's router and 4 experts with top-1 routing, each expert's tokens written back by index into
    zeros_like(tokens)."""

    cast = False

    def ffn(self, h):
        flat = h.reshape(-1, h.shape[-1])
        weight, idx = self.router(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            chosen = idx == e
            y = expert(flat[chosen]) * weight[chosen, None]
            out[chosen] = y.to(out.dtype) if self.cast else y
        return self.drop(out.view_as(h))


class IndexedExpertsCast(IndexedExperts):
    cast = True


PLANTED = {"IndexedExperts": "precision"}
CORRECT = ["IndexedExpertsCast"]


class CacheInItsDtype(IndexedExpertsCast):
    """Keys written by index into a cache buffer the block keeps, in the buffer's dtype (inference code, gpt-fast's
    KVCache.update): under autocast the keys are bfloat16 and the write raises. Not judged: a cache is state an
    inference codebase sizes and types itself, and autocast is a training tool."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("cache", torch.zeros(16, 1024, d_model), persistent=False)

    def ffn(self, h):
        positions = torch.arange(h.shape[1], device=h.device)
        self.cache[: h.shape[0], positions] = self.k_proj(h)  # advanced indexing: an index_put into the cache
        return super().ffn(h)
