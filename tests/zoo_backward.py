"""Custom backwards written for the gradient layout a plain loss gives (contiguous) that break on another: the
gradient reaching a block's output is a transpose's whenever the next layer reads it transposed ((T, B, C) code, a
convolution over time). One views the gradient flat (raises), one reads its memory as if contiguous (computes another
derivative, silently); the twin reshapes (copies where it must)."""

import torch
import torch.nn as nn
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


PLANTED = {"ViewedGradient": "derivative", "StridesIgnored": "derivative"}
CORRECT = ["ReshapedGradient"]
