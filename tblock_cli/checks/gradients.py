"""Checks of the backward and the identity path: gradient at the input, at every parameter, the residual gain."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.anatomy.dataflow import OTHER_SHARE_MAX
from tblock_cli.checks.context import TRAINING_BACKWARD, TRAINING_INPUT, Context, eval_forward, nonfinite_kind
from tblock_cli.checks.paths import (
    OTHER_INPUTS,
    PIECEWISE_MOVE,
    dead_slices,
    multiplied,
    other_batch,
    partly_dead,
    piecewise,
    reached_parameters,
    scattered,
    unreached_by_other_inputs,
)
from tblock_cli.checks.result import Outcome, failed, passed
from tblock_cli.probes import (
    changed,
    f64,
    grads_kept,
    rel_diff,
    residual_gain,
    residual_probes,
    state_key,
    tensors,
    train_mode,
)
from tblock_cli.report import Status

# tr(J)/n of input -> output. An identity residual contributes exactly 1; the branches' own
# Jacobians are mean-zero at init, so a healthy block measures ~1.0 (Pre-LN) or ~0.9 (Post-LN, the
# LayerNorm after the add divides by the sum's std). A block without a residual measures ~0.
# 0.5 sits halfway, so neither seed nor probe noise (std ~ 1/sqrt(n) per probe) can cross it.
RESIDUAL_MIN = 0.5
# A gain near 2 counts the identity twice (x + x + f(x)); no correct block measured above 1.01.
RESIDUAL_MAX = 1.5
# A block whose every output token has the same norm (nGPT: hidden states on the unit sphere, the output a
# normalisation) fixes its output's scale whatever the input's: tr(J)/n then carries the gain |y|/|x| (1/sqrt(d) for
# unit-norm tokens out of RMS-1 ones in), and the identity path is judged on tr(J)/n / gain. Measured at d 64: nGPT
# 0.977 (raw 0.122), Pre-LN 0.979, no residual 0.002 with its output unit-normalised or not. Equal norms: within 1e-3.
SPHERE_SPREAD = 1e-3
# The identity path at large input scale: in a block whose every sublayer reads a normalised stream (Pre-LN), the
# branches' outputs stay bounded as the input grows, so out(S x) / S tends to a linear map of x (x itself, or alpha x
# with a gain on the stream) with a remainder ~|branch| / S. Measured misfits at S = 1e3: correct Pre-LN blocks
# ~1e-3 (float32) to ~1e-2 (bfloat16 rounding); an activation on the stream (gelu(x + ffn(x))) leaves gelu(S x) / S ->
# relu(x), a misfit of ~0.6 against any alpha x.
LARGE_INPUT = 1e3
LINEAR_MISFIT = 0.1
# A tensor a module keeps under such a name is a loss for the trainer to add (a load-balancing or router z-loss).
KEPT_LOSS = re.compile(r"loss|l_aux", re.I)


def grad_state(g: torch.Tensor | None) -> str:
    """What a parameter's gradient is: none, nonfinite, zero or ok (one pass each, no tensor of the gradient's size)."""
    if g is None:
        return "none"
    # min and max in one vectorised pass (7x faster than a sum and an any at a 7B-size layer's 202M elements):
    # NaN propagates to both, an inf shows in one of them; all zero when both are
    g = g.detach()
    if g.numel() == 0:
        return "zero"
    if g.layout != torch.strided:  # a sparse gradient (an nn.Embedding with sparse=True): its values are the tensor
        g = g.coalesce().values() if g.is_sparse else g.to_dense()
        if g.numel() == 0:
            return "zero"
    low, high = (t.item() for t in g.aminmax())
    if not (math.isfinite(low) and math.isfinite(high)):
        return "nonfinite"
    return "zero" if low == 0 and high == 0 else "ok"


def train_backward(ctx: Context) -> tuple[torch.Tensor | None, dict[str, str]]:
    """One train-mode backward of a random projection of the output, computed once for input_unchanged, grad_input,
    grad_params and train_state (its first step): the input's gradient and each parameter's grad_state (the
    gradients themselves are freed: at a 7B-size layer they are another copy of the weights)."""
    got = training_backward(ctx)
    return got.x_grad, got.states


@dataclass(frozen=True)
class TrainingBackward:
    """The training backward's facts; `x` and `key` (the module's state after it) are train_state's first step, valid
    while nothing has run the block since."""

    x_grad: torch.Tensor | None
    states: dict
    x: torch.Tensor
    key: tuple
    detached_losses: list = field(default_factory=list)
    reached: set = field(default_factory=set)  # ids of the parameters the training graph reaches
    buffers: list = field(default_factory=list)  # buffers the backward left a gradient on (requires_grad=True)
    # matrices whose gradient is exactly zero at half their elements or more (not all), in a rounding's pattern
    # (`scattered`): piecewise judges them at a draw of its own
    mostly_zero: tuple = ()
    # matrices the graph only multiplies by whose gradient has whole output rows or columns exactly zero, not all:
    # dead_slices judges them at other inputs and parameters
    partly_dead: dict = field(default_factory=dict)  # name -> the output axis, "rows" or "columns"


def training_backward(ctx: Context) -> TrainingBackward:
    """The TRAINING_BACKWARD probe (a raise is not kept: the next check that asks tries again)."""
    def compute() -> TrainingBackward:
        ctx.step("training backward")
        module = ctx.subject.module
        x = ctx.x().requires_grad_(True)
        saved = {n: p.grad for n, p in module.named_parameters()}
        for p in module.parameters():
            p.grad = None
        learnable = [(n, b, b.grad) for n, b in module.named_buffers() if b.requires_grad and b.is_leaf]
        try:
            before = kept_losses(module)
            raw: list = []
            hook = module.register_forward_hook(lambda _m, _a, o: raw.append(o))
            with train_mode(module, True), torch.enable_grad():
                xin = x.clone()
                try:
                    out = ctx.subject(xin)
                finally:
                    hook.remove()
                detached = detached_losses(module, before, raw)
                ctx.note(TRAINING_INPUT, changed(xin, x))  # input_unchanged reads it, even if the backward raises
                # a random projection: out.sum() would see nothing through a final LayerNorm
                w = torch.randn(out.shape, generator=ctx.gen).to(out.device)
                reached, products = reached_parameters(out), multiplied(out)
                (out.float() * w).sum().backward()
                del out
            states = {n: grad_state(p.grad) for n, p in module.named_parameters() if p.requires_grad}
            mostly_zero, dead = [], {}
            for n, p in module.named_parameters():
                if states.get(n) != "ok" or p.grad.layout != torch.strided or p.grad.dim() < 2:
                    continue
                nonzero = int(torch.count_nonzero(p.grad))
                if nonzero == p.grad.numel():  # no zero at all: the usual gradient, nothing more to read
                    continue
                if 2 * nonzero <= p.grad.numel() and scattered(p.grad == 0):
                    mostly_zero.append(n)
                elif id(p) in products and partly_dead(p.grad, products[id(p)]):
                    dead[n] = products[id(p)]
            buffers = [n for n, b, was in learnable if b.grad is not None and b.grad is not was]
        finally:
            for n, p in module.named_parameters():
                p.grad = saved[n]
            for _, b, was in learnable:
                b.grad = was
        return TrainingBackward(x.grad, states, x, state_key(module), detached, reached, buffers, tuple(mostly_zero),
                                dead)
    return ctx.probe(TRAINING_BACKWARD, compute)


def kept_losses(module: nn.Module) -> dict[str, torch.Tensor]:
    """Single-element float tensors the block's modules keep under a loss's name (KEPT_LOSS): `self.aux_loss`."""
    out = {}
    for name, m in module.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and KEPT_LOSS.search(k) and v.is_floating_point() and v.numel() == 1:
                out[f"{name}.{k}" if name else k] = v
    return out


def detached_losses(module: nn.Module, before: dict, raw: list) -> list[str]:
    """Losses a training forward kept (new objects, non-zero) without a graph, where no other loss it kept or
    returned beside its output has one: an auxiliary loss computed under no_grad or detached never trains the router
    it is for. A loss kept detached for logging beside a live one (kept or returned) is not counted."""
    if not any(p.requires_grad for p in module.parameters()):
        return []
    new = {n: t for n, t in kept_losses(module).items() if before.get(n) is not t}
    extra = [t for o in raw if isinstance(o, (tuple, list)) for t in tensors(o[1:])]
    if any(t.requires_grad for t in list(new.values()) + extra):
        return []
    return sorted(n for n, t in new.items() if t.detach().abs().item() != 0)


def check_grad_input(ctx: Context) -> Outcome:
    """Catches: no gradient, a non-finite or an all-zero gradient at the input (detach, no_grad)"""
    g, _ = train_backward(ctx)
    if g is None:
        return failed("grad_input.none")
    if not torch.isfinite(g).all():
        return failed("grad_input.nonfinite", nonfinite_kind(g))
    norm = f64(g).norm().item()
    if norm == 0:
        return failed("grad_input.zero", 0.0)
    return passed("grad_input.ok", norm)


def check_grad_params(ctx: Context) -> Outcome:
    """Catches: a parameter with no gradient (unused, under `no_grad`, detached; one outside the step's graph that
    training forwards at other seeds reach is a path random draws skip, LayerDrop's, and one that training forwards of
    other, larger inputs reach is a path the data chooses, an expert no token of the probe was routed to); a loss the training forward keeps for
    the trainer to add (`self.aux_loss`, a load-balancing or z-loss) with no graph, where no kept or returned loss has
    one (computed under `no_grad` or detached: it trains nothing); a buffer the backward leaves a gradient on
    (registered with requires_grad=True: learnable, and no optimizer built from `.parameters()` steps it); a
    parameter whose gradient is exactly zero, everywhere or at half its elements or more in a rounding's pattern (all
    but 1 %, or spread over rows and columns: whole zero rows or columns are experts no token chose), while the
    training output, at a seeded draw whose gradient is so too, moves with those elements (given random values about
    them, at half its scale; a branch that draw drops moves nothing): a round, sign or argmax on its path with
    no straight-through estimator, so they never train (weights fake-quantised by `torch.round` alone, their row's
    scale the one element with a gradient); a matrix the block multiplies by whose output rows or columns, some and
    not all, get an exactly zero gradient in training steps of the probe, of inputs of 4096 tokens, and of those with
    every parameter and floating buffer moved (a projection's output computed and never read: a fused gate/up
    projection's up half unused, keys of full width of which one head's channels are kept; a unit some draw leaves
    off, an expert no token chose, one behind a zero-initialised gate or a pruning mask, comes alive in one of them,
    and a table it indexes or slices is not judged); other zero gradients are a note (a key bias gets one by the
    softmax's shift invariance: moving it moves nothing)"""
    _, states = train_backward(ctx)
    if not states:
        return Outcome(Status.SKIP, "grad_params.no_params", 0)
    missing = [n for n, s in states.items() if s == "none"]
    nonfinite = [n for n, s in states.items() if s == "nonfinite"]
    zero = [n for n, s in states.items() if s == "zero"]
    value = f"{len(states) - len(missing)}/{len(states)}"
    if missing:
        if _reached_at_other_draws(ctx, missing):  # a sublayer skipped at random (LayerDrop): the path's design
            return passed("grad_params.random_path", value, params=missing, draws=OTHER_DRAWS)
        unreached = unreached_by_other_inputs(ctx, missing, training_backward(ctx).reached)
        if not unreached:  # experts no token of the probe was routed to: the data's path
            return passed("grad_params.routed_path", value, params=missing, inputs=OTHER_INPUTS,
                          batch=other_batch(ctx))
        return failed("grad_params.missing", value, params=unreached)
    if nonfinite:
        return failed("grad_params.nonfinite", value, params=nonfinite)
    backward = training_backward(ctx)
    if backward.detached_losses:
        return failed("grad_params.loss_detached", value, losses=backward.detached_losses)
    if backward.buffers:
        return failed("grad_params.buffer_learns", value, buffers=backward.buffers)
    if (zero or backward.mostly_zero) and (stuck := piecewise(ctx, zero, backward.mostly_zero)):
        return failed("grad_params.piecewise", value, params=sorted(stuck, key=stuck.get, reverse=True), moves=stuck,
                      limit=PIECEWISE_MOVE)
    if backward.partly_dead and (dead := dead_slices(ctx, backward.partly_dead)):
        return failed("grad_params.dead", value, params=sorted(dead), slices=dead)
    return passed("grad_params.ok", value, zero=zero)


# Training forwards at other seeds where a parameter got no gradient: a sublayer LayerDrop skips at rate p for the
# whole batch is reached in one of them but with probability p^4 (0.0001 at p = 0.1, 0.06 at 0.5).
OTHER_DRAWS = 4


def _reached_at_other_draws(ctx: Context, missing: list[str]) -> bool:
    """Whether every parameter without a gradient is reached by the graph of some training forward at another seed
    (no backward: the graph's leaves are read): a path that random draws skip, not a parameter the block never uses."""
    from tblock_cli.checks.training import seeded
    from tblock_cli.subject import first_tensor

    params = dict(ctx.subject.module.named_parameters())
    left = {id(params[n]) for n in missing if n in params}
    if len(left) != len(missing) or left & training_backward(ctx).reached:  # in the graph, yet no gradient: not a path
        return False
    x = ctx.x()
    for seed in range(1, OTHER_DRAWS + 1):
        with seeded(ctx.device, seed), train_mode(ctx.subject.module, True), torch.enable_grad():
            try:
                out = first_tensor(ctx.subject(x))
            except Exception:  # noqa: BLE001 - a forward that raises here is the training check's to report
                return False
        left -= reached_parameters(out)
        if not left:
            return True
    return False


def layer_inputs(layers: list[nn.Module], run: Callable[[], object]) -> list[torch.Tensor]:
    """The input each layer saw during run(), captured with forward pre-hooks."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach())) for layer in layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def on_sphere(y: torch.Tensor) -> bool:
    """Every token of y (..., d) has the same norm, within SPHERE_SPREAD or twice its dtype's epsilon (unit vectors
    rounded to half precision spread by up to 1.04e-3 in float16, 8.2e-3 in bfloat16, measured at d 64): an output
    that is a normalisation."""
    spread = max(SPHERE_SPREAD, 2 * torch.finfo(y.dtype).eps) if y.dtype.is_floating_point else SPHERE_SPREAD
    norms = f64(y.detach()).norm(dim=-1).flatten()
    return norms.numel() > 1 and bool(norms.min() > 0) and bool((norms.max() - norms.min()) <= spread * norms.max())


def gain_of(x: torch.Tensor, y: torch.Tensor) -> float:
    """RMS(y) / RMS(x)."""
    return (f64(y.detach()).square().mean().sqrt() / f64(x.detach()).square().mean().sqrt().clamp_min(1e-300)).item()


def check_residual(ctx: Context) -> Outcome:
    """Catches: no identity path: tr(J)/n < 0.5 (Pre-LN ~1.0, Post-LN ~0.9, none ~0), per layer for built-in stacks;
    where every output token has one norm (nGPT's unit sphere), tr(J)/n per unit of the output's gain RMS(y)/RMS(x);
    the identity counted twice (> 1.5); a residual taken after the norm (doubling the input leaves the output
    unchanged); in a Pre-LN block, an identity path that is not linear at large input scale (an activation applied to
    the residual stream: gelu(x + ffn(x)))"""
    module, x = ctx.subject.module, ctx.standard()[0]
    with train_mode(module, False), grads_kept(module):
        layers = list(getattr(module, "layers", [])) if ctx.subject.builtin else []
        if layers:
            inputs = layer_inputs(layers, lambda: eval_forward(ctx, x))
            gains = []
            for i, (layer, inp) in enumerate(zip(layers, inputs)):
                ctx.step(f"Jacobian probes, layer {i + 1}/{len(layers)}")
                gains.append(residual_gain(layer, inp, ctx.gen))
        else:
            ctx.step(f"{residual_probes(x.numel())} Jacobian probes")
            gains = [residual_gain(ctx.subject, x, ctx.gen)]
    worst = min(range(len(gains)), key=gains.__getitem__)
    layer = lambda i: i if len(gains) > 1 else None  # noqa: E731 - a layer index only for a stack
    sphere = on_sphere(ctx.standard()[1])
    if not gains[worst] >= RESIDUAL_MIN:
        per_gain = gains[worst] / gain_of(x, ctx.standard()[1]) if sphere and not layers else None
        if per_gain is None or not per_gain >= RESIDUAL_MIN:
            return failed("residual.missing", round(gains[worst], 4), layer=layer(worst), gain=gains[worst], limit=RESIDUAL_MIN,
                          per_gain=per_gain)
        return passed("residual.sphere", round(per_gain, 4), gain=gains[worst], per_gain=per_gain,
                      scale=gain_of(x, ctx.standard()[1]))
    top = max(range(len(gains)), key=gains.__getitem__)
    if gains[top] > RESIDUAL_MAX:
        return failed("residual.doubled", round(gains[top], 4), layer=layer(top), gain=gains[top], limit=RESIDUAL_MAX)
    # A residual taken after the norm (h = LN(x); x = h + f(h)) still has gain ~1, but then nothing of the
    # input's scale survives: doubling the input leaves the output unchanged. Not asked of a block whose
    # output comes from a norm (Post-LN): with small branches at init it is nearly scale-invariant by design.
    doubled = rel_diff(eval_forward(ctx, 2 * x), ctx.standard()[1])
    if doubled <= ctx.tol and not ctx.dataflow().output_normed and not sphere:
        return failed("residual.after_norm", round(gains[worst], 4), change=doubled)
    bent = None if sphere or layers else identity_misfit(ctx, x)
    if bent is not None and bent > LINEAR_MISFIT:
        return failed("residual.not_linear", round(bent, 4), misfit=bent, limit=LINEAR_MISFIT, scale=LARGE_INPUT)
    return passed("residual.present", round(gains[worst], 4), gains=gains)


def identity_misfit(ctx: Context, x: torch.Tensor) -> float | None:
    """|out(S x) / S - alpha x| / |out(S x) / S| at S = LARGE_INPUT, alpha fitted per channel: how far the identity
    path is from a linear map of the input, where every sublayer of the block reads a normalised stream, the output is
    no norm's and parameters outside attention, FFN and norms are few (None elsewhere: a sublayer or gate reading the
    raw stream grows or saturates with it, and a Post-LN output stays bounded)."""
    flow = ctx.dataflow()
    if (not flow.stream_norms or flow.unnormed_ffn or flow.unnormed_attention or flow.split_kv or flow.output_normed
            or flow.sublayer_post or not flow.attention or not flow.found["ffn"]
            or flow.stray > OTHER_SHARE_MAX * flow.total):
        return None  # a gate or mixer of its own (GTrXL's GRU on the stream) may bend the stream by design
    y = f64(eval_forward(ctx, LARGE_INPUT * x)) / LARGE_INPUT
    x64 = f64(x)
    if y.shape != x64.shape or not torch.isfinite(y).all() or not y.norm() > 0:
        return None
    y2, x2 = y.reshape(-1, y.shape[-1]), x64.reshape(-1, x64.shape[-1])  # one gain per channel (NormFormer's)
    alpha = (y2 * x2).sum(0) / (x2 * x2).sum(0).clamp_min(1e-300)
    return ((y2 - alpha * x2).norm() / y2.norm()).item()
