"""Blocks whose gradients do not add up over micro-batches, and a block whose training step is not repeatable (so it
cannot be judged). Each is `TrainBlock` with one thing changed; `--block tests/zoo_accumulation.py:NAME` builds it."""

import torch
import torch.nn.functional as F
from zoo_training import TrainBlock


class _WritesGrad(torch.autograd.Function):
    """A fused `x @ w.T` whose backward writes w's gradient into .grad (= where autograd would add)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.grad = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return g @ w, None


class WritesGrad(TrainBlock):
    """The FFN's down projection through _WritesGrad: w2's gradient is the last micro-batch's alone."""

    def ffn(self, h):
        return self.drop(_WritesGrad.apply(F.silu(self.w1(h)) * self.w3(h), self.w2.weight))


class FreesGrad(TrainBlock):
    """Frees every gradient at the start of a training forward ('to save memory')."""

    def forward(self, x):
        if self.training:
            for p in self.parameters():
                p.grad = None
        return super().forward(x)


class OwnDropoutStream(TrainBlock):
    """Dropout masks from its own generator, which every step advances, so no two steps are the same (correct for
    accumulation; under activation checkpointing its recompute draws other masks)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gen = torch.Generator().manual_seed(0)

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if not self.training or self.p == 0:
            return y
        keep = torch.rand(y.shape, generator=self.gen).to(y.device) >= self.p
        return y * keep / (1 - self.p)


class _StashLinear(torch.autograd.Function):
    """`x @ w.T` whose backward takes x through ctx (saved) or from the module, where every forward stashes its input."""

    @staticmethod
    def forward(ctx, x, w, module):
        ctx.module = module
        module._stash = x.detach()
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if ctx.module.from_stash:
            x = ctx.module._stash  # the latest forward's input, not this one's
        x, w = x.to(g.dtype), w.to(g.dtype)  # what the forward computed in under autocast: it trains in mixed precision
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), None


class SavedInputLinear(TrainBlock):
    """The FFN's down projection as a custom Function (Megatron-style) whose backward reads its input saved through
    ctx: right whatever runs between its forward and its backward."""

    from_stash = False

    def ffn(self, h):
        return self.drop(_StashLinear.apply(F.silu(self.w1(h)) * self.w3(h), self.w2.weight, self))


class StashedInputLinear(SavedInputLinear):
    """The same backward reading the input the module stashed at its latest forward: right for forward, backward,
    forward, backward; wrong once two micro-batches run their forwards before their backwards (pipeline schedules)."""

    from_stash = True


PLANTED = {"WritesGrad": "grad_accumulation", "FreesGrad": "grad_accumulation", "StashedInputLinear": "grad_accumulation"}
CORRECT = ["SavedInputLinear"]
