"""Checks of what training relies on: the gradient is the derivative, gradients accumulate; and what the
training-time checks share (the seeded RNG, the size gate, the modules a block keeps). One optimizer step: optimizer.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.checks.context import OWN_CLAIMS, Context
from tblock_cli.checks.result import Outcome, failed, passed, skipped
from tblock_cli.checks.stopgrad import undetached_grads
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import cast, f64, module_copy, reseed, train_mode

# The seed every evaluation of the block starts from (dropout draws the same masks in each).
PROBE_SEED = 1234
# Central differences at steps 1e-2, 3e-3 and 1e-3 along random directions, in float64. A wrong backward (a norm
# backward missing a term, a detached branch, a recompute with other dropout masks, a weight read through .data) puts
# autograd 1e-2..2 (relative) away from finite differences that agree with each other: they all converge to the true
# derivative. Everything else that separates them makes the differences disagree among themselves: truncation (~h^2),
# a kink (ReLU, max) or a jump (top-k routing) crossed inside a step, a part computed in float32 on purpose (rotary
# angles: rounding ~1e-7 / h, why the steps stay above 1e-3). So the verdict: the median difference is more than
# FD_LIMIT from autograd and more than AGREE times farther from it than from every difference. Measured (d_model 64,
# 4 seeds): correct blocks at most 4.8x (a ReLU FFN's kinks; top-2 routing 1.0x), the wrong backwards 760x and more.
FD_STEPS = (1e-2, 3e-3, 1e-3)
# Where the steps above agree with each other and not with autograd, two tiny steps read the local derivative: a
# piecewise-linear block (ReLU) has kinks near the point at every scale, and every step of 1e-3 and more averages the
# slopes of many (nn.TransformerEncoderLayer at seq 64: 301.84 at all three against autograd's 302.94; 303.14 at 1e-5,
# 302.94455 at 1e-7). Two steps that agree to LOCAL_AGREE (no kink within them, float64 rounding at 1e-8 is ~1e-8
# relative) and stand at autograd clear the direction; a wrong backward stands off autograd at any step, and a float32
# island's rounding at these steps makes the two disagree (then the verdict stands).
FD_LOCAL, LOCAL_AGREE = (1e-8, 2e-8), 1e-6
FD_LIMIT = 1e-6
AGREE = 30.0
# Random directions: over the input and every parameter jointly, then the input alone (where a detached path shows
# whole), alternating. A wrong gradient shows along almost every direction; two keep the cost at 12 forwards.
FD_DIRECTIONS = 2
FD_LOCALISE = 48  # on a failure, tensors probed alone to name the worst (6 forwards each)
# The training-time checks copy, rebuild or difference the whole block several times over: at a 7B-size layer (202M
# parameters) that is gigabytes and tens of seconds, past the battery's budget there (docs/performance.md). Above this
# many parameters they skip and say so; the bugs they look for show at any width.
LARGE_PARAMS = 50_000_000


def too_large(ctx: Context) -> Outcome | None:
    """A skip for a block above LARGE_PARAMS, else None."""
    n = sum(p.numel() for p in ctx.subject.module.parameters())
    return skipped("training.too_large", params=n, limit=LARGE_PARAMS) if n > LARGE_PARAMS else None


@contextmanager
def seeded(device: torch.device, seed: int = PROBE_SEED):
    """The global RNG (CPU, and the device's) at a fixed seed for a while; the caller's state restored after."""
    with forked(device):
        reseed(seed)
        yield


def forked(device: torch.device):
    """torch's RNG (CPU, and the device's) forked: whatever runs inside, the caller's state is restored after (Python's
    and NumPy's streams are not touched)."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    return torch.random.fork_rng(devices=devices)


def all_modules(module: nn.Module) -> list[nn.Module]:
    """The module's submodules and the modules they keep as plain attributes (an HF layer's model), each once."""
    out, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop(0)
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        todo += list(m.children()) + [v for k, v in vars(m).items() if isinstance(v, nn.Module) and k != "_modules"]
    return out


def block_claims(ctx: Context) -> tuple:
    """What a block of the user's says of itself (card.own's claims); nothing for an hf: layer, whose config is what
    transformers computes from (measured: the 89 driven types' cards agree with what their configs and modules state)."""
    from tblock_cli.card.own import own_claims
    from tblock_cli.card.own_layers import with_layer_claims
    from tblock_cli.subject.loading import constructed_arguments

    if ctx.subject.name.startswith("hf:"):
        return ()
    module = ctx.subject.module

    def read() -> tuple:
        modules, arguments = all_modules(module), constructed_arguments(module)
        return with_layer_claims(own_claims(modules, arguments), modules, arguments)

    return ctx.probe(OWN_CLAIMS, read)


def has_dropout(module: nn.Module) -> bool:
    """A dropout that is active in train mode: a Dropout module with p > 0, or a dropout rate an attention reads."""
    for m in all_modules(module):
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any("dropout" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items()):
            return True
    return False


def copied(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters keep the gradient hooks the original's carry (`p.register_hook`: a deep copy
    drops them), so that what a copy's backward leaves in .grad is what the block's own would."""
    twin = module_copy(module)
    for (_, a), (_, b) in zip(module.named_parameters(remove_duplicate=False), twin.named_parameters(remove_duplicate=False)):
        hooks = getattr(a, "_backward_hooks", None)
        if hooks and b.requires_grad and not getattr(b, "_backward_hooks", None):
            for hook in hooks.values():
                b.register_hook(hook)
    return twin


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- the gradient is the derivative


def check_derivative(ctx: Context) -> Outcome:
    """Catches: a gradient that is finite but not the derivative: autograd's directional derivative against central
    finite differences (float64 copy, train mode, dropout active, RNG reseeded before every evaluation) along 2
    random directions (input and parameters jointly, input alone), the median of steps 1e-2, 3e-3, 1e-3 more than
    1e-6 and 30x their own spread away from autograd (differences that agree with each other, not with autograd; a
    kink or a float32 island makes them disagree); names the worst tensor (a custom backward, a `.detach()` or
    `.data` on a path, a recompute with other dropout masks); the upstream gradient is laid out in reverse (not
    contiguous, as under a consumer that transposes the output): a backward that reads its memory as contiguous is
    caught by the differences, one that raises on it and not on a contiguous one fails (`.view` of the gradient).
    Where every tensor that disagrees is one along which the block is flat at every step and jumps when it moves by
    half its scale (a rounding: quantisation-aware training's straight-through estimator, a rounded gate), the
    gradient is a surrogate by design and passes; a tensor the forward never reads while the backward gives it a
    gradient (a custom function's forgotten bias) still fails. Where autograd agrees with the differences once every
    `.detach()` of a tensor computed from parameters alone is undone (DoRA's weight norm, a quantiser's scale from the
    weights), the gap is that documented approximation and passes, saying so; a stop-gradient on the data's path (a
    norm's statistics detached) still fails"""
    if (large := too_large(ctx)) is not None:
        return large
    device = ctx.device if ctx.device.type != "mps" else torch.device("cpu")
    try:
        m64 = cast(copied(ctx.subject.module), torch.float64, device)
    except Exception as e:  # noqa: BLE001 - a block that has no float64 cannot be differenced precisely
        if is_out_of_memory(e):
            raise
        return skipped("derivative.no_float64", error=one_line(e))
    subject = ctx.subject.like(m64)
    x = f64(ctx.x()).to(device)
    params = trainable(m64)

    def value(xin: torch.Tensor) -> torch.Tensor:
        with seeded(device), train_mode(m64, True):
            return (subject(xin) * w).sum()

    ctx.step("float64 backward")
    with seeded(device), train_mode(m64, True), torch.enable_grad():
        xr = x.clone().requires_grad_(True)
        try:
            out = subject(xr)
        except Exception as e:  # noqa: BLE001
            if is_out_of_memory(e):
                raise
            return skipped("derivative.no_float64", error=one_line(e))
        # the projection laid out in reverse (dimension order), so the gradient reaching the block's output is not
        # contiguous, as under a consumer that transposes it ((T, B, C) layers, a conv over time): a backward that
        # views it flat raises, one that reads its memory as if contiguous computes another derivative
        w = torch.randn(out.shape[::-1], generator=ctx.gen, dtype=torch.float64).to(device).permute(
            *range(out.dim() - 1, -1, -1))
        for _, p in params:
            p.grad = None
        try:  # .backward, not autograd.grad: a reentrant checkpoint inside refuses the latter
            (out * w).sum().backward()
        except Exception as e:  # noqa: BLE001 - a custom backward written for float32 (`g.float()` meeting float64):
            if is_out_of_memory(e):  # its own dtype's backward is grad_input's and grad_params' to judge
                raise
            if out.dim() > 1 and _runs_contiguous(subject, m64, x, w.contiguous(), device):
                return failed("derivative.layout", None, error=one_line(e))
            return skipped("derivative.no_float64", error=one_line(e))
    if not torch.isfinite(out).all():
        return skipped("derivative.nonfinite")
    gx = xr.grad if xr.grad is not None else torch.zeros_like(x)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in params]
    originals = [p.detach().clone() for _, p in params]
    dropout = has_dropout(m64)

    def direction(which: set[int] | None) -> tuple[torch.Tensor, list]:
        """A random direction over the input (index -1) and the parameters; which=None: all of them jointly."""
        on = (lambda i: True) if which is None else (lambda i: i in which)
        dx = torch.randn(x.shape, generator=ctx.gen).to(device, torch.float64) if on(-1) else None
        dps = []
        for i, (_, p) in enumerate(params):
            if not on(i):
                dps.append(None)
                continue
            scale = originals[i].pow(2).mean().sqrt().item() if p.numel() else 0.0
            # drawn in float32 (half the cost of float64 draws): any direction will do, its values are exact
            d = torch.randn(p.shape, generator=ctx.gen).to(device, torch.float64)
            dps.append(d.mul_(scale if scale > 0 else 1.0))
        return dx, dps

    def ends(dx, dps, h: float) -> list[float]:
        """The block's value at h and at -h along the direction, the parameters put back after."""
        with torch.no_grad():
            out = []
            for sign in (1.0, -1.0):
                for (_, p), orig, d in zip(params, originals, dps):
                    if d is not None:  # in place: no temporaries the size of the weights
                        p.copy_(orig).add_(d, alpha=sign * h)
                out.append(value(x + sign * h * dx if dx is not None else x).item())
            for (_, p), orig, d in zip(params, originals, dps):
                if d is not None:
                    p.copy_(orig)
        return out

    def along(dx, dps, h: float) -> float:
        plus, minus = ends(dx, dps, h)
        return (plus - minus) / (2 * h)

    def errors(dx, dps, floor: float = 0.0) -> tuple[list[float], float]:
        """[distance of the median difference from autograd, spread of the differences], both relative; |autograd|."""
        exact = (gx * dx).sum().item() if dx is not None else 0.0
        exact += sum((g * d).sum().item() for g, d in zip(grads, dps) if d is not None)
        fds = sorted(along(dx, dps, h) for h in FD_STEPS)
        center = fds[len(fds) // 2]
        scale = max(abs(exact), abs(center), floor, 1e-300)
        distance, spread = abs(center - exact) / scale, max(abs(f - center) for f in fds) / scale
        if distance > FD_LIMIT and distance > AGREE * spread:  # alike, and not autograd: kinks within the steps?
            a, b = (along(dx, dps, h) for h in FD_LOCAL)
            if abs(a - b) / scale <= LOCAL_AGREE and abs(a - exact) / scale <= LOCAL_AGREE:
                spread = max(spread, abs(a - center) / scale)  # the local derivative is autograd's: the steps mislead
        return [distance, spread], abs(exact)

    def consistent(errs: list[float]) -> bool:
        distance, spread = errs
        return distance > FD_LIMIT and distance > AGREE * spread

    ctx.step(f"{FD_DIRECTIONS} finite-difference directions")
    joint = [direction(None if k % 2 == 0 else {-1}) for k in range(FD_DIRECTIONS)]
    found = [errors(*d) for d in joint]
    worst = max(errs[0] for errs, _ in found)
    facts = {"error": worst, "errors": [{"distance": errs[0], "spread": errs[1]} for errs, _ in found],
             "steps": list(FD_STEPS), "limit": FD_LIMIT, "agree": AGREE, "dropout": dropout, "directions": FD_DIRECTIONS}
    if not any(consistent(errs) for errs, _ in found):
        return passed("derivative.matches", worst, **facts)
    # Which tensor: each alone (the input, then the parameters), relative to the joint derivative's size.
    ctx.step("finite differences per tensor")
    floor = max(size for _, size in found) * 1e-6

    def stepwise(dps: list) -> bool:
        """Whether the block is flat along dps at every finite-difference step yet moves when the tensor moves by half
        its scale, either way: a piecewise-constant path (a rounding) whose gradient is a surrogate by design."""
        if any(along(None, dps, h) != 0.0 for h in FD_STEPS):
            return False
        with torch.no_grad():
            base = value(x).item()
        unit = [None if d is None else d * (o.pow(2).mean().sqrt() / d.pow(2).mean().sqrt().clamp_min(1e-300))
                for d, o in zip(dps, originals)]  # at its tensor's RMS: a scalar's draw may be small
        return any(end != base for end in ends(None, unit, SURROGATE_MOVE))

    wrong, surrogate, apart = [], [], []
    for i in [-1] + list(range(len(params)))[:FD_LOCALISE]:
        dx, dps = direction({i})
        errs, _ = errors(dx, dps, floor=floor)
        if consistent(errs):
            wrong.append(["input" if i < 0 else params[i][0], errs[0]])
            apart.append((dx, dps))
            if i >= 0 and stepwise(dps):
                surrogate.append(params[i][0])
    wrong.sort(key=lambda t: -t[1])
    if wrong and len(surrogate) == len(wrong):  # every disagreement a straight-through estimator's surrogate
        return passed("derivative.surrogate", worst, **facts, tensors=surrogate)
    ctx.step("autograd with stop-gradients on parameters alone undone")
    with seeded(device), train_mode(m64, True):
        undone = undetached_grads(subject, x, w, params)
    if undone is not None:  # the differences agree with autograd once they are: a documented approximation
        gx, grads, count = undone
        if not any(consistent(errors(*d)[0]) for d in joint) and not any(
                consistent(errors(dx, dps, floor=floor)[0]) for dx, dps in apart):
            return passed("derivative.stop_gradient", worst, **facts, tensors=[t for t, _ in wrong], detached=count)
    return failed("derivative.wrong", worst, **facts, tensors=wrong, tensor=wrong[0][0] if wrong else None,
                  tensor_error=wrong[0][1] if wrong else 0.0)


# A tensor along which the block is flat at every finite-difference step is moved by this much of its scale (either
# way) to tell a rounding, whose output then jumps (a straight-through estimator's gradient is a surrogate by design:
# QAT, a rounded gate), from a tensor the forward never reads while a custom backward gives it a gradient
SURROGATE_MOVE = 0.5


def _runs_contiguous(subject, module, x: torch.Tensor, w: torch.Tensor, device) -> bool:
    """Whether the float64 training step whose backward raised on a gradient laid out in reverse runs with the same
    gradient contiguous."""
    with seeded(device), train_mode(module, True), torch.enable_grad():
        try:
            (subject(x.clone().requires_grad_(True)) * w).sum().backward()
        except Exception as e:  # noqa: BLE001 - it raises either way: not the layout's doing
            if is_out_of_memory(e):
                raise
            return False
    return True
