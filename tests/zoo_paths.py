"""Paths a gradient takes, or does not: weights fake-quantised by `torch.round` with no straight-through estimator
(their row's scale the one element that learns), a rounded gate, a router that only picks (every chosen weight 1: it
never trains); and the sparse MoE that skips the experts no token chose, whose unreached experts are the data's
path, not unused parameters (a false alarm of `grad_params` and `train_eval` before). Each planted bug beside a twin.
And parts of a matrix no gradient ever reaches (a fused gate/up projection whose up half is never read, keys and values
of full width of which one head's channels are kept), beside designs whose zero rows come alive at other inputs or
parameters (adaLN-Zero's zero gates, structured pruning's mask, a dense layer of 64 experts at top-1, activation
sparsity) or are not outputs at all (one-hot positions times a table)."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


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


class RoundedGateSTE(RoundedGate):
    """Correct: the same rounded gate with a straight-through estimator (its gradient passes as if unrounded): flat at
    every finite-difference step, a surrogate gradient by design (derivative.surrogate, not a wrong backward)."""

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        rounded = torch.round(self.gate * 2) / 2
        return x + (self.gate + (rounded - self.gate).detach()) * self.ffn(self.ffn_norm(x))


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


class FusedGateUp(TrainBlock):
    """Correct: SwiGLU with its gate and up projections fused in one matrix (Phi-3's gate_up_proj), chunked."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3
        self.w1 = nn.Linear(d_model, 2 * self.w2.in_features, bias=False)

    def ffn(self, h):
        gate, up = self.w1(h).chunk(2, -1)
        return self.drop(self.w2(F.silu(gate) * up))


class UpHalfUnread(FusedGateUp):
    """The fused projection's up half never read (`silu(gate) * gate`): half its rows never train."""

    def ffn(self, h):
        gate, _up = self.w1(h).chunk(2, -1)
        return self.drop(self.w2(F.silu(gate) * gate))


class OneHeadOfWideKeys(TrainBlock):
    """Multi-query meant with k and v projections of full width: one head's channels kept, the rest computed and
    dropped (three quarters of each matrix never train)."""

    def attention(self, h):
        B, T, C = h.shape
        hs = C // self.n_heads
        q = heads(self.q_proj(h), self.n_heads)
        k, v = (p(h)[..., :hs].unsqueeze(1).expand(B, self.n_heads, T, hs) for p in (self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=self.causal,
                                           dropout_p=self.p if self.training else 0.0)
        return self.o_proj(merge(y))


class AdaLNZero(TrainBlock):
    """Correct: DiT's adaLN-Zero, its condition a learned vector (a fixed timestep and class): the modulation starts at
    zero, so the gates are 0 and the shift and scale rows get no gradient until the gates move."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.condition = nn.Parameter(torch.randn(d_model))
        self.modulation = nn.Linear(d_model, 6 * d_model)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x):
        s1, b1, g1, s2, b2, g2 = self.modulation(F.silu(self.condition)).chunk(6, -1)
        x = x + g1 * self.drop(self.attention(self.attn_norm(x) * (1 + s1) + b1))
        return x + g2 * self.ffn(self.ffn_norm(x) * (1 + s2) + b2)


class PrunedUnits(TrainBlock):
    """Correct: structured pruning, a mask buffer zeroing a quarter of the FFN's units in w1 (their w3 rows then meet
    a zero gate)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        mask = torch.ones(self.w1.out_features, 1)
        mask[::4] = 0
        self.register_buffer("w1_mask", mask)

    def ffn(self, h):
        return self.drop(self.w2(F.silu(F.linear(h, self.w1.weight * self.w1_mask)) * self.w3(h)))


class DenseExperts(TrainBlock):
    """Correct: 64 experts of 8 units in one matrix, computed for every token and weighted by the top-1 router's
    probability (zero for the others): an expert no token chose has zero rows."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w3, self.w2
        self.router = nn.Linear(d_model, 64, bias=False)
        self.experts_in = nn.Linear(d_model, 64 * 8)
        self.experts_out = nn.Linear(64 * 8, d_model)

    def ffn(self, h):
        probs = self.router(h).softmax(-1)
        top, idx = probs.max(-1, keepdim=True)
        weight = torch.zeros_like(probs).scatter(-1, idx, top)
        hidden = F.gelu(self.experts_in(h)).unflatten(-1, (64, 8)) * weight.unsqueeze(-1)
        return self.drop(self.experts_out(hidden.flatten(-2)))


class SparseActivations(TrainBlock):
    """Correct: each token keeps its 4 largest FFN units (activation sparsity): a unit no token of a batch kept has
    zero rows."""

    def ffn(self, h):
        a = F.silu(self.w1(h)) * self.w3(h)
        keep = torch.zeros_like(a).scatter(-1, a.abs().topk(4, -1).indices, 1.0)
        return self.drop(self.w2(a * keep))


class OneHotPositions(TrainBlock):
    """Correct: a learned position table read by one-hot positions times the table (rows past the sequence are never
    read: inputs of the product, not its outputs)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.pos = nn.Parameter(torch.randn(256, d_model) * 0.02)

    def forward(self, x):
        onehot = F.one_hot(torch.arange(x.shape[1], device=x.device), 256).to(x.dtype)
        return super().forward(x + onehot @ self.pos)


PLANTED = {"QuantisedNoStraightThrough": ("grad_params", "grad_params.piecewise"),
           "RoundedGate": ("grad_params", "grad_params.piecewise"),
           "RouterOnlyPicks": ("grad_params", "grad_params.missing"),
           "UpHalfUnread": ("grad_params", "grad_params.dead"),
           "OneHeadOfWideKeys": ("grad_params", "grad_params.dead")}
CORRECT = ["QuantisedFFN", "RoundedGateSTE", "SparseMoE", "FusedGateUp", "AdaLNZero", "PrunedUnits", "DenseExperts", "SparseActivations",
           "OneHotPositions"]
