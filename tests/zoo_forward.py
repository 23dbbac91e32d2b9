"""Planted bugs the forward checks catch (shape, finite, determinism, input_unchanged, need_weights, dtype), and blocks
that fail to load or build."""

import torch
import torch.nn.functional as F
from zoo_correct import Good


class DropoutInEval(Good):
    def forward(self, x, pad_mask=None):
        return F.dropout(super().forward(x, pad_mask), 0.1, training=True)  # bug: ignores self.training


class NoiseInEval(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + 1e-3 * torch.randn_like(x)  # bug: random in eval


class InputMutated(Good):
    def forward(self, x, pad_mask=None):
        x += self.sa(self.ln1(x), pad_mask)  # bug: in-place on the caller's tensor
        return x + self.ffn(self.ln2(x))


class InputScaledInPlace(Good):
    def forward(self, x, pad_mask=None):
        x.mul_(1.0001)  # bug: a tiny in-place rescale of the input
        return super().forward(x, pad_mask)


class EpsZero(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **{**k, "eps": 0.0})  # bug: NaN on a constant token


class PostLNEpsZero(Good):
    """Post-LN whose norms have eps=0: a constant input token does not reach a norm constant."""

    def __init__(self, *a, **k):
        super().__init__(*a, **{**k, "eps": 0.0})

    def forward(self, x, pad_mask=None):
        x = self.ln1(x + self.sa(x, pad_mask))
        return self.ln2(x + self.ffn(x))


class _RootNorm(torch.nn.Module):
    """RMSNorm divided by the root itself, eps outside it (`x / (sqrt(mean x^2) + eps)`): finite at a zero token, and
    the root's derivative there infinite (`rooted=True`); or by `F.normalize`'s clamped norm, whose backward at a zero
    vector is zero (`rooted=False`, nGPT's and many unit-norm blocks' choice)."""

    def __init__(self, d, rooted=True, eps=1e-6):
        super().__init__()
        self.rooted, self.eps = rooted, eps
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        if self.rooted:
            return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight
        return F.normalize(x, dim=-1, eps=self.eps) * x.shape[-1] ** 0.5 * self.weight


class RootAtZero(Good):
    """A padding token's zero embedding: the block's output is finite, its gradient NaN (and so every weight's)."""

    rooted = True

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.1, causal=False, eps=1e-6):
        super().__init__(d_model, n_heads, d_ff, dropout, causal)
        self.ln1, self.ln2 = _RootNorm(d_model, self.rooted, eps), _RootNorm(d_model, self.rooted, eps)


class ClampedNormAtZero(RootAtZero):
    """Correct: the same norm through `F.normalize`, whose derivative at a zero token is finite."""

    rooted = False


class WrongShape(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask)[:, -1]  # bug: last token only, (B, d)


class TransposedOutput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask).transpose(0, 1)  # bug: (T, B, d)


class NeedWeightsOn(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask, need_weights=True)  # bug: weights computed, dropped
        return x + self.ffn(self.ln2(x))


class NaNForward(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + torch.sqrt(x.sum(-1, keepdim=True) - 1e9)  # bug: sqrt of negative


class LargeInputOverflow(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) + torch.exp(x).mean(-1, keepdim=True) * 0  # bug: exp overflows on large input


class Counter(Good):
    """Output depends on how many times it was called: eval is not a pure function."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x, pad_mask=None):
        self.calls += 1  # bug: state that changes the output
        return super().forward(x, pad_mask) + 1e-2 * self.calls


class PrecisionLoss(Good):
    """Adds and removes a large offset: exact in float64, ~1e-3 absolute error in float32."""

    def forward(self, x, pad_mask=None):
        return (super().forward(x, pad_mask) + 1e4) - 1e4  # bug: catastrophic cancellation


class ReturnsDict(Good):
    def forward(self, x, pad_mask=None):
        return {"out": super().forward(x, pad_mask)}  # not a tensor: a load error, exit 2


class BrokenForward(Good):
    def forward(self, x, pad_mask=None):
        raise RuntimeError("boom")


class FailsWithGrad(Good):
    """Loads fine (the probe runs under no_grad) but raises when autograd records: a measuring failure."""

    def forward(self, x, pad_mask=None):
        if torch.is_grad_enabled():
            raise RuntimeError("grad path broken")
        return super().forward(x, pad_mask)


def factory_raises(d_model=64):
    raise ValueError("bad width")


def not_a_module(d_model=64):
    return 42


class AllocationFails(Good):
    """The CPU allocator's out-of-memory error, as PyTorch words it: an out-of-memory exit (2), not a block error."""

    def forward(self, x, pad_mask=None):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes")


class Printing(Good):
    """Prints on import of nothing, but in __init__ and forward: --json must stay valid JSON on stdout."""

    def __init__(self, *a, **k):
        print("building Printing")
        super().__init__(*a, **k)

    def forward(self, x, pad_mask=None):
        print("forward of Printing")
        return super().forward(x, pad_mask)


class UpcastsOutput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x, pad_mask) * torch.ones(1, dtype=torch.float64)  # bug: the output becomes float64
