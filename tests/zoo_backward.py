"""Custom backwards written for the gradient layout a plain loss gives (contiguous) that break on another: the
gradient reaching a block's output is a transpose's whenever the next layer reads it transposed ((T, B, C) code, a
convolution over time). One views the gradient flat (raises), one reads its memory as if contiguous (computes another
derivative, silently); the twin reshapes (copies where it must). And a custom function whose forward forgets the
bias its backward gives a gradient: flat in the bias at any size, so not excused as a rounding's surrogate."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock


class _Gain(torch.autograd.Function):
    """y = x * w per channel, with its backward written by hand over the gradient flattened to (tokens, channels)."""

    flatten = staticmethod(lambda g: g.reshape(-1, g.shape[-1]))

    @classmethod
    def forward(cls, ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @classmethod
    def backward(cls, ctx, g):
        x, w = ctx.saved_tensors
        g2 = cls.flatten(g)
        return (g2 * w).reshape(x.shape), (g2 * x.reshape(-1, x.shape[-1])).sum(0)


class _ViewedGain(_Gain):
    flatten = staticmethod(lambda g: g.view(-1, g.shape[-1]))  # bug: .view needs a contiguous gradient


class _StridedGain(_Gain):
    # bug: the gradient's memory read as a contiguous tensor of its shape (a kernel that takes no strides)
    flatten = staticmethod(lambda g: torch.as_strided(g, g.shape, torch.empty(g.shape).stride(),
                                                      g.storage_offset()).reshape(-1, g.shape[-1]))


class ReshapedGradient(TrainBlock):
    """Correct: an output gain with a hand-written backward that reshapes its gradient."""

    gain_fn = _Gain

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gain = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return self.gain_fn.apply(super().forward(x), self.gain)


class ViewedGradient(ReshapedGradient):
    gain_fn = _ViewedGain


class StridesIgnored(ReshapedGradient):
    gain_fn = _StridedGain


class _BiasInBackwardOnly(torch.autograd.Function):
    """x @ w.T with the bias forgotten in the forward, while the backward returns its gradient as if it were added."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        flat = g.reshape(-1, g.shape[-1])
        return g @ w, flat.t() @ x.reshape(-1, x.shape[-1]), flat.sum(0)


class BiasInBackwardOnly(TrainBlock):
    """The FFN's output projection by a custom function that forgets its bias in the forward: the forward is flat in
    the bias at any size, so its gradient is no rounding's surrogate but a wrong backward."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.w2 = nn.Linear(self.w2.in_features, d_model)

    def ffn(self, h):
        return self.drop(_BiasInBackwardOnly.apply(F.silu(self.w1(h)) * self.w3(h), self.w2.weight, self.w2.bias))


PLANTED = {"ViewedGradient": "derivative", "StridesIgnored": "derivative", "BiasInBackwardOnly": "derivative"}
CORRECT = ["ReshapedGradient"]
