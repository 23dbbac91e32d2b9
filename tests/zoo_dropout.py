"""Dropout written by the block itself, for the `dropout` check: masks that are not rescaled by 1 / (1 - p), or
rescaled twice; and the correct twins: a rescaled hand-made mask, classic dropout (unscaled in training, scaled by
1 - p in eval), a post-norm block with functional dropout before each norm, gating noise the dropout rate does not
govern. Each is `TrainBlock` of tests/zoo_training.py with one method changed."""

import math

import torch
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge

# ----------------------------------------------------------------------------- correct twins

class ManualDropoutBlock(TrainBlock):
    """Dropout written by hand, rescaled: a mask from rand and the kept elements divided by 1 - p."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if not self.training or self.p == 0:
            return y
        return y * (torch.rand_like(y) >= self.p) / (1 - self.p)


class ClassicDropout(TrainBlock):
    """Dropout as first published: kept elements unscaled in training, the eval output scaled by 1 - p instead."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if not self.training:
            return y * (1 - self.p)
        return y * (torch.rand_like(y) >= self.p)


class PostNormOwnDropout(TrainBlock):
    """Post-norm with functional dropout in the block's own forward, before each norm (a norm after the add bends the
    mean over masks: torch's dropouts are not judged by their mean)."""

    def forward(self, x):
        drop = lambda t: F.dropout(t, self.p, self.training)  # noqa: E731
        x = self.attn_norm(x + drop(self.attention(x)))
        return self.ffn_norm(x + drop(self.w2(F.silu(self.w1(x)) * self.w3(x))))



class DropPath(torch.nn.Module):
    """Stochastic depth as timm writes it: one keep/drop draw per sample, the kept divided by the keep rate."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class StochasticDepth(TrainBlock):
    """Both branches behind a DropPath: few independent draws (one per sample), each scaled right."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.drop_path = DropPath(dropout)

    def forward(self, x):
        x = x + self.drop_path(self.attention(self.attn_norm(x)))
        return x + self.drop_path(self.ffn(self.ffn_norm(x)))


class NoisyGating(TrainBlock):
    """A gate on the FFN with noise on its logits in training (noisy top-k gating's idea): random at any dropout rate,
    and not expectation-preserving by design."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gate = torch.nn.Linear(d_model, 1)

    def ffn(self, h):
        logit = self.gate(h)
        if self.training:
            logit = logit + torch.randn_like(logit)
        return torch.sigmoid(logit) * self.w2(F.silu(self.w1(h)) * self.w3(h))


# ----------------------------------------------------------------------------- planted bugs

class UnscaledDropout(TrainBlock):
    """Hand-written FFN dropout that forgets to rescale: in expectation the FFN's output shrinks by 1 - p in training."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        if not self.training or self.p == 0:
            return y
        return y * (torch.rand_like(y) >= self.p)  # bug: no / (1 - p)


class DoubleScaledDropout(TrainBlock):
    """F.dropout already rescales; dividing by 1 - p again grows the FFN's output in training."""

    def ffn(self, h):
        y = F.dropout(self.w2(F.silu(self.w1(h)) * self.w3(h)), self.p, self.training)
        return y / (1 - self.p) if self.training else y  # bug: a second rescale


class UnscaledAttentionDropout(TrainBlock):
    """Attention written out, its probabilities masked in training without the rescale (rows then sum to ~1 - p)."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if self.causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        a = s.softmax(-1)
        if self.training and self.p > 0:
            a = a * (torch.rand_like(a) >= self.p)  # bug: no / (1 - p)
        return self.o_proj(merge(a @ v))



class UnscaledDropPath(StochasticDepth):
    """Stochastic depth whose kept samples are not divided by the keep rate: in training each branch shrinks by 1 - p
    in expectation (one draw per sample: the check averages over more masks)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.drop_path = UnscaledPath(dropout)


class UnscaledPath(DropPath):
    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)  # bug: no / (1 - p)


CORRECT = ["ManualDropoutBlock", "ClassicDropout", "PostNormOwnDropout", "StochasticDepth", "NoisyGating"]
PLANTED = {"UnscaledDropout": "dropout.biased", "DoubleScaledDropout": "dropout.rescaled",
           "UnscaledAttentionDropout": "dropout.biased", "UnscaledDropPath": "dropout.biased"}


class FrozenMask(TrainBlock):
    """A dropout mask drawn once, at construction, and applied at every training step (no new mask per step)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("mask", (torch.rand(d_model) >= dropout) / (1 - dropout), persistent=False)

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        return y * self.mask if self.training else y  # bug: the same mask every step


PLANTED["FrozenMask"] = "dropout.rescaled"


class FixedRateUnscaled(UnscaledDropout):
    """UnscaledDropout whose constructor takes no dropout argument (its rate fixed at 0.1 inside): the check zeroes
    the rate through the attribute the forward reads, `self.p`."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, 0.1, causal)


PLANTED["FixedRateUnscaled"] = "dropout.biased"


class EvalScaledToo(TrainBlock):
    """Inverted dropout in training and the classic eval scale `* (1 - p)` as well: the eval output shrinks by the
    rate, so training's mean is not the eval output."""

    def ffn(self, h):
        y = self.w2(F.silu(self.w1(h)) * self.w3(h))
        return self.drop(y) if self.training else y * (1 - self.p)


PLANTED["EvalScaledToo"] = "dropout.rescaled"


# ----------------------------------------------------------------------------- where the dropout sits, its rate, its draws


class StreamDropout(TrainBlock):
    """The dropout after the residual add: the stream itself dropped, so a tenth of the identity path is cut at every
    training step (`x = drop(x + f(x))` where `x = x + drop(f(x))` was meant)."""

    def forward(self, x):
        x = self.drop(x + self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


class DroppedIdentity(TrainBlock):
    """The residual branch and the identity both behind the dropout: `drop(x) + drop(f(x))`."""

    def forward(self, x):
        x = self.drop(x) + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


class KeepProbDropout(TrainBlock):
    """The rate read as a keep probability (as TensorFlow 1's `keep_prob`): built with dropout=0.1, it drops 90 % of
    its residual branches' elements."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.drop = torch.nn.Dropout(1 - dropout)


class BatchSharedMask(TrainBlock):
    """A locked (variational) dropout written for sequence-first tensors, mask (1, B, C) held over time, applied to
    batch-first ones: the mask is (1, T, C), one for the whole batch."""

    def locked(self, y):
        if not self.training or self.p == 0:
            return y
        return y * y.new_empty(1, y.shape[1], y.shape[2]).bernoulli_(1 - self.p) / (1 - self.p)

    def forward(self, x):
        x = x + self.locked(self.attention(self.attn_norm(x)))
        return x + self.locked(self.w2(F.silu(self.w1(self.ffn_norm(x))) * self.w3(self.ffn_norm(x))))


PLANTED.update({"StreamDropout": "dropout.stream", "DroppedIdentity": "dropout.stream",
                "KeepProbDropout": "dropout.rate", "BatchSharedMask": "dropout.shared"})


class LockedDropout(BatchSharedMask):
    """The same locked dropout with its mask laid out for batch-first tensors, (B, 1, C): one mask per sample, held
    over the positions (as AWD-LSTM's, on the right axis)."""

    def locked(self, y):
        if not self.training or self.p == 0:
            return y
        return y * y.new_empty(y.shape[0], 1, y.shape[2]).bernoulli_(1 - self.p) / (1 - self.p)


class BatchModeDepth(TrainBlock):
    """Stochastic depth as torchvision's `StochasticDepth(p, mode="batch")`: each branch kept or dropped for the whole
    batch at once, the kept scaled by 1 / (1 - p); a decision per forward, not a mask shared by mistake."""

    def depth(self, y):
        if not self.training or self.p == 0:
            return y
        return y * (torch.rand(()) >= self.p) / (1 - self.p)

    def forward(self, x):
        x = x + self.depth(self.attention(self.attn_norm(x)))
        return x + self.depth(self.w2(F.silu(self.w1(self.ffn_norm(x))) * self.w3(self.ffn_norm(x))))


class BranchInputDropout(TrainBlock):
    """The dropout on the branch's input (`x + f(drop(norm(x)))`): every dropout dropping all still leaves x."""

    def forward(self, x):
        x = x + self.attention(self.drop(self.attn_norm(x)))
        return x + self.ffn(self.drop(self.ffn_norm(x)))


class FixedAttentionRate(TrainBlock):
    """Attention dropout fixed at 0.1 whatever the constructor's dropout (which the residual dropouts follow): a rate
    that does not move with the argument is not judged."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=0.1 if self.training else 0.0)
        return self.o_proj(merge(y))


CORRECT += ["LockedDropout", "BatchModeDepth", "BranchInputDropout", "FixedAttentionRate"]


class DropConnect(TrainBlock):
    """DropConnect (Wan et al., 2013), as Mixout writes it too: a rescaled mask on the FFN's output weight, one per
    forward, shared by the batch by design (a weight's mask, not an activation's)."""

    def ffn(self, h):
        w = self.w2.weight
        if self.training and self.p > 0:
            w = w * torch.empty_like(w).bernoulli_(1 - self.p) / (1 - self.p)
        return F.linear(F.silu(self.w1(h)) * self.w3(h), w)


class DropKey(TrainBlock):
    """DropKey (Li et al., 2023): keys masked at random before the softmax, drawn with F.dropout over ones; each
    query keeps its own key, so no row is left empty (with every dropout dropping all, each attends to itself)."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        T = h.shape[1]
        own = torch.eye(T, dtype=torch.bool, device=h.device)
        if self.training:
            s = s.masked_fill((F.dropout(torch.ones_like(s), self.p, True) == 0) & ~own, float("-inf"))
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        return self.o_proj(merge(s.softmax(-1) @ v))


class HalfRateAttention(TrainBlock):
    """Attention dropout at half the residual rate: a rate that rises with the argument, by a factor."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.p / 2 if self.training else 0.0)
        return self.o_proj(merge(y))


CORRECT += ["DropConnect", "DropKey", "HalfRateAttention"]


# ----------------------------------------------------------------------------- planted: dropout on the scores


class ScoresDropout(TrainBlock):
    """Attention dropout on the scores before the softmax (meant for the probabilities after it): a dropped score
    becomes 0, not -inf, and the kept ones are scaled by 1 / (1 - p), sharpening every row."""

    drop_scores = staticmethod(lambda s, p, training: F.dropout(s, p, training))

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        s = self.drop_scores((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), self.p, self.training)
        T = h.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        return self.o_proj(merge(s.softmax(-1) @ v))


class ScoresMaskedUnscaled(ScoresDropout):
    """The same place, a hand-made mask and no rescale: dropped scores 0, the kept ones as they were."""

    drop_scores = staticmethod(lambda s, p, training: s * (torch.rand_like(s) >= p) if training else s)


class ProbsDropout(ScoresDropout):
    """Correct twin: the same attention with its dropout on the probabilities."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        T = h.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        return self.o_proj(merge(F.dropout(s.softmax(-1), self.p, self.training) @ v))


PLANTED.update({"ScoresDropout": "dropout.on_scores", "ScoresMaskedUnscaled": "dropout.on_scores"})
CORRECT += ["ProbsDropout"]


class RateIgnored(TrainBlock):
    """Takes dropout 0.1 and keeps TrainBlock's nn.Dropout, and calls it nowhere (SDPA's dropout_p left at 0): the
    rate it is built with is ignored. Its twin is TrainBlock, which drops both branches' outputs."""

    def forward(self, x):
        x = x + self.attention(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        return self.o_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)))


class NoDropoutModules(RateIgnored):
    """The same forward, and no dropout module kept: a block written for dropout 0 (gpt-fast's, Llama's) takes a rate
    it does not use, and says nothing of it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.drop


IGNORED = {"RateIgnored": "dropout.never_applied"}
