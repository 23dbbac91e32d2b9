"""Blocks for what a step leaves behind and what a batch shares: a tensor kept on the block whose autograd graph each
training step extends (grad_accumulation.graph_carried), against the same tensors overwritten by each call; torch's
BatchNorm in a convolution module (samples meet in its batch statistics by design, batch.batch_norm) against a batch
mean that leaks beside it; and norms whose class names say nothing: the unbiased variance (norms.not_unit) and a gain
applied before the statistics of a module its block names a norm (norms.gain_inside, a warning); a linear attention,
whose q, k and v names a product with no softmax after it cannot contradict; and one projection under two names
(optimizer_step.repeated), against an alias the forward calls once."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from zoo_training import RMSNorm, TrainBlock, heads, merge


class _Routed(TrainBlock):
    """Top-2 of 4 experts, renormalised; the router's balance loss is what the subclasses keep."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.router = nn.Linear(d_model, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                                   nn.Linear(2 * d_model, d_model)) for _ in range(4))
        self.aux_loss = torch.zeros(())

    def balance(self, probs):
        return probs.mean((0, 1)).pow(2).sum() * probs.shape[-1]

    def keep(self, loss):
        self.aux_loss = loss

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        self.keep(self.balance(probs))
        top, idx = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (top * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return self.drop(out)


class AuxLossPerCall(_Routed):
    """Correct: the balance loss of this call kept for the training loop to add (Switch-style), overwritten by the
    next call, and a list of this call's losses."""

    def keep(self, loss):
        self.aux_loss = loss
        self.aux_losses = [loss]


class AuxLossSummedAcrossCalls(_Routed):
    """The balance loss summed into the attribute on every call and never reset: step n's graph holds steps 1..n-1's,
    memory grows with every step, and a loss that reads it backpropagates into freed graphs."""

    def keep(self, loss):
        self.aux_loss = self.aux_loss + loss


class RunningStatWithGraph(TrainBlock):
    """A running mean square of the input, through a learned temperature, assigned in training without no_grad: the
    buffer carries every step's graph into the next."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("running_ms", torch.ones(()))
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, x):
        if self.training:
            self.running_ms = 0.9 * self.running_ms + 0.1 * (x * self.temperature).pow(2).mean()
        x = x * self.temperature
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


class ConvModuleBatchNorm(TrainBlock):
    """Correct: a Conformer's convolution module between attention and FFN (pointwise, GLU, depthwise, BatchNorm,
    SiLU, pointwise): in training its BatchNorm normalises over the batch, as torch's does by design. Bidirectional."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, False)
        self.conv_norm = nn.LayerNorm(d_model)
        self.pointwise_in = nn.Conv1d(d_model, 2 * d_model, 1)
        self.depthwise = nn.Conv1d(d_model, d_model, 3, padding=1, groups=d_model)
        self.batch_norm = nn.BatchNorm1d(d_model)
        self.pointwise_out = nn.Conv1d(d_model, d_model, 1)

    def centre(self, h):
        return h

    def conv(self, x):
        h = F.glu(self.pointwise_in(self.conv_norm(x).transpose(1, 2)), dim=1)
        h = self.pointwise_out(F.silu(self.batch_norm(self.depthwise(h))))
        return self.drop(self.centre(h.transpose(1, 2)))

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        x = x + self.conv(x)
        return x + self.ffn(self.ffn_norm(x))


class BatchNormBesideBatchMean(ConvModuleBatchNorm):
    """The convolution module's output centred over the batch in training as well (a batch mean of its own): samples
    meet there whatever BatchNorm does."""

    def centre(self, h):
        return h - h.mean(0, keepdim=True) if self.training else h


class CentredScale(nn.Module):
    """A LayerNorm by another name, dividing by the unbiased variance (`x.var()`, n - 1)."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True) + self.eps) * self.weight + self.bias


class CentredScaleBiased(CentredScale):
    """Correct: the same with the variance over n, computed in float32 whatever the run dtype (as transformers'
    norms do: a float16 variance overflows past RMS 256)."""

    def forward(self, x):
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + self.eps)
        return h.to(x.dtype) * self.weight + self.bias


class GainFirst(RMSNorm):
    """The gain applied before the statistics: x * w divided by the RMS of x * w."""

    def forward(self, x):
        h = x * self.weight
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


class UnbiasedNormBlock(TrainBlock):
    norm_class = CentredScale


class BiasedNormBlock(TrainBlock):
    """Correct."""

    norm_class = CentredScaleBiased


class GainFirstNormBlock(TrainBlock):
    norm_class = GainFirst


class LinearAttention(TrainBlock):
    """Correct: causal linear attention (elu + 1 features, running sums of k v^T and k): no softmax, so the first
    product the dataflow meets is k with v."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.einsum("bhtd,bhte->bhtde", k, v).cumsum(2)
        num = torch.einsum("bhtd,bhtde->bhte", q, kv)
        return self.o_proj(merge(num / ((q * k.cumsum(2)).sum(-1, keepdim=True) + 1e-6)))


class QueryIsKey(TrainBlock):
    """`self.q_proj = self.k_proj = nn.Linear(...)`: one projection for both, so queries equal keys."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.q_proj = self.k_proj = nn.Linear(d_model, d_model, bias=False)


class GateIsUp(TrainBlock):
    """`self.w1 = self.w3 = nn.Linear(...)`: the SwiGLU's gate and up are one projection, silu(a) * a."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.w1 = self.w3 = nn.Linear(d_model, int(8 * d_model / 3), bias=False)


class OldNameKept(TrainBlock):
    """Correct: the output projection also registered under the name old checkpoints use (`wo`), called once."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.wo = self.o_proj


class _Checkpointed(_Routed):
    """The expert layer under non-reentrant activation checkpointing in training, as memory-bound MoE code does; the
    subclasses say what the checkpointed part writes on the block."""

    def routed(self, h):
        probs = self.router(h).softmax(-1)
        self.write(probs)
        top, idx = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            out = out + (top * (idx == e)).sum(-1, keepdim=True) * expert(h)
        return out

    def ffn(self, h):
        if self.training:
            return self.drop(checkpoint(self.routed, h, use_reentrant=False))
        return self.drop(self.routed(h))


class AuxListInRecompute(_Checkpointed):
    """Appends the balance loss to a list the trainer sums, emptied at each call: the recompute in the backward
    appends it a second time."""

    def write(self, probs):
        self.aux_losses.append(self.balance(probs))

    def forward(self, x):
        self.aux_losses = []
        return super().forward(x)


class LoadCountInRecompute(_Checkpointed):
    """Counts the tokens each expert gets in a buffer (a load statistic): the recompute counts them again."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.register_buffer("load", torch.zeros(4))

    def write(self, probs):
        with torch.no_grad():
            self.load += F.one_hot(probs.argmax(-1), 4).sum((0, 1)).to(self.load.dtype)


class AuxKeptOutsideCheckpoint(_Checkpointed):
    """Correct: the balance loss computed outside the checkpointed part (the router runs again there, writing
    nothing), and a gradient hook that keeps the router's last gradient norm, written in the backward only."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.router_grad_norm = 0.0
        self.router.weight.register_hook(self.note)

    def note(self, g):
        self.router_grad_norm = g.norm().item()

    def write(self, probs):
        pass

    def ffn(self, h):
        self.keep(self.balance(self.router(h).softmax(-1)))
        return super().ffn(h)


class ProbabilitiesKeptUnderCheckpoint(_Checkpointed):
    """Correct: keeps the router's probabilities for a plot inside the checkpointed part; the recompute writes them
    again, with the same values."""

    def write(self, probs):
        self.last_probs = probs.detach()


class StatsKeptInOneDict(TrainBlock):
    """Correct: one dict of statistics for a monitor, the output's RMS written by the forward and its gradient's RMS by
    a hook in the backward: the backward adds its own entry and rewrites none of the forward's."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.stats = {}

    def forward(self, x):
        y = super().forward(x)
        self.stats["out_rms"] = y.detach().pow(2).mean().sqrt()
        if y.requires_grad:
            y.register_hook(lambda g: self.stats.__setitem__("grad_rms", g.pow(2).mean().sqrt()))
        return y


class GateDroppedInInferenceMode(TrainBlock):
    """A serving path taken under torch.inference_mode only (`torch.is_inference_mode_enabled()`), written apart from
    the training one: it forgets the FFN's gate. Under no_grad, as in every eval the battery runs, the path is right."""

    def ffn(self, h):
        if torch.is_inference_mode_enabled():
            return self.drop(self.w2(self.w3(h)))
        return super().ffn(h)


class StatsSkippedInInferenceMode(TrainBlock):
    """Correct: the same serving branch computing the same output; it only skips keeping a statistic."""

    def forward(self, x):
        y = super().forward(x)
        if not torch.is_inference_mode_enabled():
            self.last_rms = float(y.detach().pow(2).mean().sqrt())
        return y


PLANTED = {"AuxListInRecompute": ("train_state", "train_state.recompute_writes"),
           "LoadCountInRecompute": ("train_state", "train_state.recompute_writes"),
           "AuxLossSummedAcrossCalls": ("grad_accumulation", "grad_accumulation.graph_carried"),
           "RunningStatWithGraph": ("grad_accumulation", "grad_accumulation.graph_carried"),
           "BatchNormBesideBatchMean": ("batch", "batch.leak_train"),
           "UnbiasedNormBlock": ("norms", "norms.not_unit"),
           "GainFirstNormBlock": ("norms", "norms.gain_inside"),
           "QueryIsKey": ("optimizer_step", "optimizer_step.repeated"),
           "GateIsUp": ("optimizer_step", "optimizer_step.repeated"),
           "GateDroppedInInferenceMode": ("train_state", "train_state.inference_path")}
CORRECT = ["AuxLossPerCall", "BiasedNormBlock", "OldNameKept", "AuxKeptOutsideCheckpoint",
           "ProbabilitiesKeptUnderCheckpoint", "StatsKeptInOneDict", "StatsSkippedInInferenceMode"]
