"""Paths a gradient takes, or does not: weights fake-quantised by `torch.round` with no straight-through estimator
(their row's scale the one element that learns), a rounded gate, a router that only picks (every chosen weight 1: it
never trains); and the sparse MoE that skips the experts no token chose, whose unreached experts are the data's
path, not unused parameters (a false alarm of `grad_params` and `train_eval` before). Each planted bug beside a twin."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock


def fake_quant(w: torch.Tensor, straight_through: bool) -> torch.Tensor:
    """4-bit symmetric per-row quantisation; with a straight-through estimator the gradient passes as if unrounded."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 7
    q = torch.round(w / scale).clamp(-8, 7) * scale
    return w + (q - w).detach() if straight_through else q


class QuantisedFFN(TrainBlock):
    """Correct: quantisation-aware training of the FFN's weights, through a straight-through estimator."""

    straight_through = True

    def ffn(self, h):
        w1, w3, w2 = (fake_quant(lin.weight, self.straight_through) for lin in (self.w1, self.w3, self.w2))
        return self.drop(F.linear(F.silu(F.linear(h, w1)) * F.linear(h, w3), w2))


class QuantisedNoStraightThrough(QuantisedFFN):
    """The rounding left in the graph: every weight's gradient is zero but its row's largest, through the scale."""

    straight_through = False


class RoundedGate(TrainBlock):
    """A scalar gate on the FFN branch rounded to steps of 0.5 with no straight-through: its gradient is exactly 0."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.gate = nn.Parameter(torch.tensor(1.2))

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        return x + torch.round(self.gate * 2) / 2 * self.ffn(self.ffn_norm(x))


class SparseMoE(TrainBlock):
    """Correct: 32 experts, one per token, each run on the tokens routed to it only (an expert no token chose is not
    called: Mixtral's loop over the experts hit), weighted by the router's softmax probability."""

    experts_n, top_k = 32, 1

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.router = nn.Linear(d_model, self.experts_n, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 32), nn.GELU(), nn.Linear(32, d_model))
                                     for _ in range(self.experts_n))

    def weights(self, logits, top):
        return logits.softmax(-1).gather(-1, top)

    def ffn(self, h):
        logits = self.router(h)
        top = logits.topk(self.top_k, -1).indices
        w = self.weights(logits, top)
        out = torch.zeros_like(h)
        flat, hf, wf, tf = out.view(-1, h.shape[-1]), h.reshape(-1, h.shape[-1]), w.reshape(-1, self.top_k), top.reshape(-1, self.top_k)
        for e in tf.unique().tolist():
            tok, slot = (tf == e).nonzero(as_tuple=True)
            flat = flat.index_add(0, tok, (wf[tok, slot, None] * self.experts[e](hf[tok])).to(flat.dtype))
        return self.drop(flat.view_as(h))


class RouterOnlyPicks(SparseMoE):
    """The router chooses and every chosen weight is 1 (torch.ones where its probability was meant): no gradient
    reaches it, and routing stays as initialised."""

    experts_n = 8

    def weights(self, logits, top):
        return torch.ones(top.shape, dtype=logits.dtype, device=logits.device)


PLANTED = {"QuantisedNoStraightThrough": ("grad_params", "grad_params.piecewise"),
           "RoundedGate": ("grad_params", "grad_params.piecewise"),
           "RouterOnlyPicks": ("grad_params", "grad_params.missing")}
CORRECT = ["QuantisedFFN", "SparseMoE"]
