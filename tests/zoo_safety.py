"""Planted bugs the safety checks catch: state a training step writes (train_state), a copy that is not one (copy),
dropout or early returns that only eval sees (train_eval)."""

import torch
import torch.nn.functional as F
from zoo_correct import Good
from zoo_positions import Rel3


class SDPADropoutInEval(Rel3):
    """Its attention dropout defaults to 0 and the constructor does not take it: dropout=0.1 is never injected."""

    def __init__(self, d_model=64, n_heads=4, d_ff=None, causal=True):
        super().__init__(d_model, n_heads, d_ff, 0.0, causal)
        self.attn_dropout = 0.0

    def attend(self, q, k, v, allowed):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=self.attn_dropout)  # bug: in eval too


class EvalReturnsEarly(Rel3):
    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        if not self.training:
            return x  # bug: eval skips the FFN
        return x + F.dropout(self.ffn(self.ffn_norm(x)), self.p, self.training)


class ClosureCapture(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        norm = self.ffn_norm
        self.prenorm = lambda t: norm(t)  # bug: a closure over the submodule: a deepcopy still calls the original

    def forward(self, x, pad_mask=None):
        x = x + self.attention(self.attn_norm(x), pad_mask)
        return x + F.dropout(self.ffn(self.prenorm(x)), self.p, self.training)


class TrainStateHistory(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("k_cache", None, persistent=False)

    def attention(self, h, pad_mask):
        if self.training:
            self.k_cache = self.k_proj(h)  # bug: a cache written in a training forward keeps the graph alive
        return super().attention(h, pad_mask)


class TrainRunningStat(Rel3):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("running", torch.ones(()))

    def forward(self, x, pad_mask=None):
        if self.training:
            self.running = 0.9 * self.running + 0.1 * x.pow(2).mean()  # bug: a running statistic updated with grad on
        return super().forward(x / self.running.sqrt(), pad_mask)


class FirstCallInit(Good):
    """Correct: a data-dependent init in the first forward (ActNorm written output-first): the first output ever is not
    what the block computes afterwards, so no check may take its first forward for a later one."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x, pad_mask=None):
        y = super().forward(x, pad_mask) * self.gain
        if not bool(self.ready):
            with torch.no_grad():
                self.gain.copy_(1.0 / y.std())
                self.ready.fill_(True)
        return y


class StepDependentInplace(Good):
    """From the second training step on, an in-place op on a tensor autograd saved: that step's backward raises, though
    its graph shares nothing with the first step's."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = 0

    def forward(self, x, pad_mask=None):
        y = super().forward(x, pad_mask)
        if self.training and torch.is_grad_enabled():
            self.steps += 1
            if self.steps >= 2:
                s = torch.sigmoid(y)
                return s.mul_(2)  # bug: sigmoid saved its output, modified in place
        return y


class InferenceModeCache(Rel3):
    """cos/sin cached per shape at their first use: a validation pass under torch.inference_mode() (Lightning runs
    one before training) builds them as inference tensors, and the next training step's rotation saves them for
    backward, which autograd refuses."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.cache = {}

    def cos_sin(self, pos, dtype):
        key = (tuple(pos.shape), dtype, pos.device)
        if key not in self.cache:
            self.cache[key] = super().cos_sin(pos, dtype)
        return self.cache[key]


class InferenceModeCacheCloned(InferenceModeCache):
    """The same cache, cloned where it is used: a clone made outside inference mode is an ordinary tensor."""

    def cos_sin(self, pos, dtype):
        return tuple(t.clone() for t in super().cos_sin(pos, dtype))
