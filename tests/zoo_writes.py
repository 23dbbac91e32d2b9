"""Forwards that write the block's own parameters (input_unchanged.parameters), a mode switch that freezes them
(train_state.frozen), and correct blocks that write only what a forward may: buffers, and an nn.Embedding's rows under
its own max_norm (torch renormalises them by design)."""

import torch
import torch.nn as nn
from zoo_training import TrainBlock


class NormalisedInForward(TrainBlock):
    """nGPT's weight normalisation done in the training forward instead of after the optimizer's step: the optimizer's
    moments belong to weights the next forward replaces."""

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.w2.weight.div_(self.w2.weight.norm(dim=0, keepdim=True))
        return super().forward(x)


class StandardisedInPlace(TrainBlock):
    """Weight standardisation written into the stored weight through .data by the training forward (no autograd
    version bump to see it by), instead of computed on a copy the gradient flows through: the gradient misses the
    standardisation's Jacobian and the optimizer steps a weight the next forward replaces."""

    def ffn(self, h):
        if self.training:
            w = self.w1.weight.data
            self.w1.weight.data = (w - w.mean(1, keepdim=True)) / w.std(1, keepdim=True)
        return super().ffn(h)


class LengthInBuffer(TrainBlock):
    """The last call's length kept in a buffer every forward writes: a buffer, not a parameter, so nothing the
    optimizer steps changes."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("length", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        self.length.fill_(x.shape[1])
        return super().forward(x)


class MaxNormPositions(TrainBlock):
    """Learned absolute positions from an nn.Embedding with max_norm, added before the block's norms: torch
    renormalises the rows it looks up in place, by design."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.pos = nn.Embedding(1024, d_model, max_norm=1.0)

    def forward(self, x):
        return super().forward(x + self.pos(torch.arange(x.shape[1], device=x.device)))


class EvalFreezes(TrainBlock):
    """eval() overridden to freeze every parameter (an inference speed-up); train() does not thaw them: the training
    loop after a validation pass trains nothing, silently (an optimizer skips parameters without gradients)."""

    def train(self, mode=True):
        super().train(mode)
        if not mode:
            for p in self.parameters():
                p.requires_grad_(False)
        return self


PLANTED = {"NormalisedInForward": "input_unchanged", "StandardisedInPlace": "input_unchanged", "EvalFreezes": "train_state"}
CORRECT = ["LengthInBuffer"]
