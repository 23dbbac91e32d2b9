"""Blocks under torch.autocast, for the `precision` check: a mixture of experts that writes each expert's output into
a buffer made like the input by index (under autocast the experts compute in bfloat16, the buffer stays float32, and
the write raises), and the correct twin that casts before it writes."""

import torch
import torch.nn.functional as F
from zoo_training import MoEBlock, TrainBlock


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


class ResidualCastToStream(TrainBlock):
    """Each branch's output cast to the stream's dtype before it is added: under autocast the stream stays float32."""

    def add(self, x, y):
        return x + y.to(x.dtype)

    def forward(self, x):
        x = self.add(x, self.drop(self.attention(self.attn_norm(x))))
        return self.add(x, self.ffn(self.ffn_norm(x)))


class ResidualTypeAsBranch(ResidualCastToStream):
    """`(x + y).type_as(y)`: under autocast the branch is bfloat16, so the residual stream (a float32 input's output)
    drops to bfloat16 at every block, which no error per position above bfloat16's rounding shows."""

    def add(self, x, y):
        return (x + y).type_as(y)


class _Linear(torch.autograd.Function):
    """`x @ w.T` by hand; its backward casts to the gradient's dtype (what the forward's autocast computed in) or not."""

    @staticmethod
    def forward(ctx, x, w, cast):
        ctx.save_for_backward(x, w)
        ctx.cast = cast
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if ctx.cast:
            w, x = w.to(g.dtype), x.to(g.dtype)
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), None


class CustomLinearCast(TrainBlock):
    """The FFN's down projection through _Linear, whose backward casts: it trains under autocast."""

    cast = True

    def ffn(self, h):
        return self.drop(_Linear.apply(F.silu(self.w1(h)) * self.w3(h), self.w2.weight, self.cast))


class CustomLinearNoCast(CustomLinearCast):
    """No cast and no custom_fwd/custom_bwd: its autocast forward runs (bfloat16), and the backward, outside autocast,
    multiplies a bfloat16 gradient by the float32 weight and raises: the block cannot train in mixed precision."""

    cast = False


PLANTED = {"IndexedExperts": "precision", "ResidualTypeAsBranch": "precision", "CustomLinearNoCast": "precision"}
CORRECT = ["IndexedExpertsCast", "ResidualCastToStream", "CustomLinearCast"]


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
