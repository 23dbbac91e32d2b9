"""Blocks that run on the CPU and would raise on a GPU, for the `device` check: tensors created in the forward
without `device=`, a host tensor saved for a backward; and the correct twins: the same tensors created on the
input's device, registered as buffers, moved lazily by code that reads where they are, host scalars and host indices
(CUDA takes both). Each is `TrainBlock` of tests/zoo_training.py with one method changed."""


import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import Rotary, TrainBlock, attend

# ----------------------------------------------------------------------------- would raise on a GPU


class MaskFromHostArange(TrainBlock):
    """The causal mask from torch.arange(T) without device=: a host tensor meeting the scores."""

    def attention(self, h):
        T = h.shape[1]
        return attend(self, h, torch.arange(T)[:, None] >= torch.arange(T)[None, :])


class MaskAsPlainAttribute(TrainBlock):
    """The causal mask kept as a plain attribute, not a buffer: `.to()` leaves it behind (state_dict's warning)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.mask = torch.ones(256, 256, dtype=torch.bool).tril()

    def attention(self, h):
        T = h.shape[1]
        return attend(self, h, self.mask[:T, :T])


class HostDropoutMask(TrainBlock):
    """A hand-made dropout mask from torch.rand(shape): drawn on the host, met with the activations in training."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if not self.training:
            return y
        return y * (torch.rand(y.shape) >= self.p) / (1 - self.p)


class HostPositions(TrainBlock):
    """Learned absolute positions looked up with torch.arange(T) on the host: the embedding's index meets its weight."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.pos = nn.Embedding(256, d_model)

    def forward(self, x):
        return super().forward(x + self.pos(torch.arange(x.shape[1])))


class HostRotaryAngles(TrainBlock):
    """Rotary angles from positions built on the host: torch.outer(arange(T), inv_freq)."""

    class HostRotary(Rotary):
        def angles(self, T, device):
            return torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq.float())

    rotary_class = HostRotary


class _HostScaledBackward(torch.autograd.Function):
    """The identity whose backward multiplies by ones the forward built on the host and saved."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.ones(x.shape[-1], dtype=x.dtype))
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (ones,) = ctx.saved_tensors
        return g * ones


class HostTensorInBackward(TrainBlock):
    """A custom autograd function that saves a host tensor for its backward: forwards run, backwards raise on a GPU."""

    def ffn(self, h):
        return super().ffn(_HostScaledBackward.apply(h))


# ----------------------------------------------------------------------------- correct twins


class MaskOnInputDevice(TrainBlock):
    """The causal mask from torch.arange(T, device=h.device)."""

    def attention(self, h):
        T, dev = h.shape[1], h.device
        return attend(self, h, torch.arange(T, device=dev)[:, None] >= torch.arange(T, device=dev)[None, :])


class MaskAsBuffer(MaskAsPlainAttribute):
    """The causal mask registered as a buffer: `.to()` moves it (and the state_dict carries it)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        mask = self.__dict__.pop("mask")
        self.register_buffer("mask", mask)


class LazilyMovedMask(TrainBlock):
    """A mask made on the host and moved by code that reads where it is (on a GPU the test is true and it moves)."""

    def attention(self, h):
        T = h.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if mask.device != h.device:
            mask = mask.to(h.device)
        return attend(self, h, mask)


class MovedHostTensors(TrainBlock):
    """Host tensors moved before they meet the block's: .to(h.device), .to(h), type_as and x.new_tensor; a host
    scalar; host indices into a device tensor; a mask drawn with rand_like."""

    def ffn(self, h):
        T = h.shape[1]
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        ramp = torch.linspace(1.0, 1.0, T, dtype=h.dtype).to(h.device)[:, None] * torch.ones(1, h.shape[-1]).to(h)
        y = y * ramp * torch.tensor(1.0) + h.new_tensor([0.0]) + torch.zeros(T, 1).type_as(h)
        y = y[:, torch.arange(T)]
        if self.training:
            y = y * (torch.rand_like(y) >= self.p) / (1 - self.p)
        return y


CORRECT = ["MaskOnInputDevice", "MaskAsBuffer", "LazilyMovedMask", "MovedHostTensors"]
# MaskAsPlainAttribute is state_dict's finding (a plain tensor the forward reads, which .to() leaves behind): device
# does not judge plain attributes, since a model's caches set up after it was moved are made on its device
PLANTED = ["MaskFromHostArange", "HostDropoutMask", "HostPositions", "HostRotaryAngles",
           "HostTensorInBackward"]
