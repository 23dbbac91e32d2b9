"""Blocks that leave state behind: process-wide state changed from their forward (or constructor), module state
written at every eval call; and correct twins that touch the same state and put it back, or write the same values. Each is `TrainBlock` with one thing changed; `--block tests/zoo_global.py:NAME` builds it."""

import random

import numpy as np
import torch
from zoo_training import TrainBlock

# ----------------------------------------------------------------------------- bugs


class ReseedsInTraining(TrainBlock):
    """'Reproducible' dropout: each training forward reseeds torch, so every step draws the same masks."""

    def forward(self, x):
        if self.training:
            torch.manual_seed(1234)
        return super().forward(x)


class SetSeedInEval(TrainBlock):
    """A set_seed helper called for 'deterministic evaluation': Python's and NumPy's streams reset too."""

    def forward(self, x):
        if not self.training:
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
        return super().forward(x)


class GradOffInEval(TrainBlock):
    """Turns grad mode off for its inference path and never turns it back on."""

    def forward(self, x):
        if not self.training:
            torch.set_grad_enabled(False)
        return super().forward(x)


class Float64Default(TrainBlock):
    """Sets the default dtype to float64 in its constructor (for a precise table) and leaves it so."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        torch.set_default_dtype(torch.float64)


class LowerMatmulPrecision(TrainBlock):
    """Asks for TF32-class float32 matmuls for the whole process from its forward."""

    def forward(self, x):
        torch.set_float32_matmul_precision("medium")
        return super().forward(x)


class EvalRunningMean(TrainBlock):
    """A running mean of its input for a calibration feature, updated in eval too (no self.training guard)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("running_mean", torch.zeros(d_model))

    def forward(self, x):
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * x.mean((0, 1)))
        return super().forward(x)


class KeepsInputs(TrainBlock):
    """Appends every input to a list (a debugging aid left in): memory grows with every call."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach())
        return super().forward(x)


# ----------------------------------------------------------------------------- correct twins


class ForkedNoise(TrainBlock):
    """Noise drawn inside torch.random.fork_rng (the caller's stream put back) and its own generator."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            x = x + 0.0 * torch.randn_like(x)
        return super().forward(x + 0.0 * torch.randn(x.shape, generator=self.gen).to(x.device))


class ScopedSwitches(TrainBlock):
    """Grad mode, autocast and the default dtype changed only inside scopes that put them back."""

    def forward(self, x):
        with torch.no_grad():
            _ = x.sum()
        with torch.autocast("cpu", enabled=False):
            y = super().forward(x)
        saved = torch.get_default_dtype()
        try:
            torch.set_default_dtype(torch.float64)
        finally:
            torch.set_default_dtype(saved)
        return y


class LazyTables(TrainBlock):
    """A cos/sin table rebuilt whenever the length changes and a key cache written at positions 0..T-1 on every call
    (Meta's llama writes its cache so): state written, the same values each time for the same input."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("table", torch.zeros(0), persistent=False)
        self.last = None

    def forward(self, x):
        B, T, _ = x.shape
        if "cache" not in self._buffers:  # allocated at the first call, as a generation loop's cache is; an ordinary
            with torch.inference_mode(False):  # tensor even when that call is a validation pass under inference mode
                self.register_buffer("cache", torch.full((4, 512, x.shape[-1]), float("nan")), persistent=False)
        if self.table.shape[0] != T:
            self.table = torch.arange(T, dtype=torch.float32).cos()
        with torch.no_grad():
            self.cache[:B, :T] = x.detach()
        self.last = x.detach().sum(-1)  # replaced each call, the same values for the same input
        return super().forward(x)


class HookPerCall(TrainBlock):
    """A forward hook registered inside forward, never removed: one more on the output projection at every call."""

    def forward(self, x):
        self.o_proj.register_forward_hook(lambda m, args, out: None)  # bug: a hook per call
        return super().forward(x)


class HooksOnce(TrainBlock):
    """Hooks installed lazily at the first call (a capture hook, as transformers' output recording installs its own)
    and a hook registered and removed inside every call: nothing stays beyond the first call."""

    def forward(self, x):
        if not self._forward_hooks:
            self.register_forward_hook(lambda m, args, out: None)
        handle = self.w2.register_forward_pre_hook(lambda m, args: None)
        try:
            return super().forward(x)
        finally:
            handle.remove()


class PythonLayerDrop(TrainBlock):
    """Each sublayer skipped for the whole batch with probability 0.3, drawn from Python's stream (x-transformers'
    layer_dropout: `random() < p`): what tblock compares between two seeded runs must draw the same skips."""

    def forward(self, x):
        if not (self.training and random.random() < 0.3):
            x = x + self.drop(self.attention(self.attn_norm(x)))
        if not (self.training and random.random() < 0.3):
            x = x + self.ffn(self.ffn_norm(x))
        return x


class SkipsFirstStep(TrainBlock):
    """The attention sublayer skipped in its first training forward only, as a layer drop's draw may skip it in the one
    step grad_params reads: other training forwards reach its parameters (`grad_params.random_path`)."""

    steps = 0

    def forward(self, x):
        if self.training:
            self.steps += 1
        if not (self.training and self.steps == 1):
            x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


class DropoutOffInTraining(TrainBlock):
    """'Deterministic attention' done by switching the block's dropout to eval inside the forward: after the first
    call it never drops again, in training too."""

    def forward(self, x):
        self.drop.eval()
        return super().forward(x)


class DropoutOnInEval(TrainBlock):
    """Monte Carlo dropout meant for one call, left on: an eval forward puts the dropout in train mode for good."""

    def forward(self, x):
        if not self.training:
            self.drop.train()
        return super().forward(x)


class EvalDropoutByOverride(TrainBlock):
    """Correct: a `train()` override keeps the FFN's dropout in eval whatever mode the caller asks (a frozen part, as
    frozen BatchNorm statistics are kept); the forward switches nothing."""

    def train(self, mode=True):
        super().train(mode)
        self.drop.eval()
        return self


class _NoWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g @ w, None  # bug: the weight's gradient never returned


class WeightGradDropped(TrainBlock):
    """w2 applied through a custom Function whose backward returns None for the weight: in the graph, no gradient."""

    def ffn(self, h):
        return self.drop(_NoWeightGrad.apply(torch.nn.functional.silu(self.w1(h)) * self.w3(h), self.w2.weight))


PLANTED = {"ReseedsInTraining": "global_state.reseeds", "SetSeedInEval": "global_state.reseeds",
           "GradOffInEval": "global_state.changed", "Float64Default": "global_state.changed",
           "LowerMatmulPrecision": "global_state.switched", "DropoutOffInTraining": "global_state.modes",
           "DropoutOnInEval": "global_state.modes"}
WRITES_IN_EVAL = ("EvalRunningMean", "KeepsInputs")  # determinism.writes_state
CORRECT = ("TrainBlock", "ForkedNoise", "ScopedSwitches", "LazyTables", "HooksOnce", "PythonLayerDrop",
           "EvalDropoutByOverride")
