"""The finite check: outputs finite on random, constant-token, zero and large inputs, each norm with eps = 0 alone, and
the gradient at the input finite where the outputs are."""

from __future__ import annotations

import torch

from tblock_cli.anatomy.norms import find_norms, with_eps
from tblock_cli.checks.context import Context, all_finite, eval_forward, forward_together, input_grad, nonfinite_kind
from tblock_cli.checks.result import Outcome, passed
from tblock_cli.errors import is_out_of_memory
from tblock_cli.report import Status

# The special inputs whose gradient at the input must be finite where their output is: a zero or a zero-variance
# token is what a padding embedding gives, and a norm's sqrt at 0 (sqrt(mean x^2) + eps, x.std()) has an infinite
# derivative there whose product with a zero is NaN, spread by the backward to every parameter
GRADIENT_INPUTS = ("constant-token", "zero")

# Input magnitude for the "large" finite probe: 1e4 in float32; 100 in half precision, whose
# max (65504 fp16) a correct Post-LN block's attention scores would already overflow at 1e3.
LARGE_SCALE = {torch.float64: 1e4, torch.float32: 1e4, torch.float16: 1e2, torch.bfloat16: 1e2}


def check_finite(ctx: Context) -> Outcome:
    """Catches: NaN/inf on random, constant-token (zero variance), zero and large inputs; each norm with `eps=0` alone
    on a zero-variance input; in float32 and float64 runs, a NaN/inf gradient at the input on constant-token and zero
    inputs whose outputs are finite (a norm's sqrt at 0: `x / (sqrt(mean x^2) + eps)`; a padding token's NaN reaches
    every weight)"""
    B, T, d = ctx.cfg.batch, ctx.cfg.seq, ctx.cfg.d_model
    scale = LARGE_SCALE[ctx.dtype]
    inputs = {
        "constant-token": ctx.randn(B, T, 1).expand(B, T, d).contiguous(),  # zero variance per token
        "zero": torch.zeros(B, T, d, device=ctx.device, dtype=ctx.dtype),
        f"x{scale:g}": ctx.x() * scale,
    }
    _, random_out = ctx.standard()
    bad, norms = [], []
    if not torch.isfinite(random_out).all():
        bad.append({"input": "random", "got": nonfinite_kind(random_out)})
    gap = list(ctx.subject.backward_gap)
    # gradients judged in float32 and float64 runs: a half-precision one overflows by its range, not by a derivative
    # (BERT's LayerNorm eps of 1e-12 gives a zero token's gradient 1e6 times the upstream one, past float16's 65504)
    wide = ctx.dtype in (torch.float32, torch.float64)
    outputs_finite, gradients_finite = side_by_side(ctx, inputs, gradients=wide)
    # a device that gives this block no gradients (FlexAttention's backward on a CPU): the outputs are still judged
    no_backward = bool(ctx.subject.backward_gap) or not wide
    if ctx.subject.backward_gap != gap:
        ctx.subject.backward_gap[1] = gap[1] if gap else 0
    if not outputs_finite:
        for label, x in inputs.items():
            ctx.step(f"{label} input")
            out = eval_forward(ctx, x)
            if not torch.isfinite(out).all():
                bad.append({"input": label, "got": nonfinite_kind(out)})
    grads = [] if bad or gradients_finite or no_backward else nonfinite_gradients(
        ctx, {k: inputs[k] for k in GRADIENT_INPUTS})
    inputs = {"random": None, **inputs}
    # Each norm alone on a zero-variance input: eps = 0 there is 0/0 whatever the block around it does.
    module = ctx.subject.module
    for name, norm in with_eps(module, find_norms(module, d, ctx.device, ctx.dtype)):
        if norm.eps > 0:
            continue
        try:
            with torch.no_grad():
                out = norm(torch.zeros(1, 2, d, device=ctx.device, dtype=ctx.dtype))
        except Exception:  # noqa: BLE001 - a norm over another shape; the block-level probes still ran
            continue
        if not torch.isfinite(out).all():
            norms.append({"name": name, "type": type(norm).__name__, "eps": float(norm.eps)})
    if bad or norms:
        # the other checks compare outputs of random inputs: only a non-finite random output leaves them nothing to read
        random_bad = any(b["input"] == "random" for b in bad)
        return Outcome(Status.FAIL, "finite.nonfinite", len(bad) + len(norms), {"inputs": bad, "norms": norms}, unmet=random_bad)
    if grads:
        # the outputs are finite: the checks that read them still run
        return Outcome(Status.FAIL, "finite.gradient", len(grads), {"inputs": grads}, unmet=False)
    return passed("finite.ok", len(inputs), inputs=list(inputs), gradients=[] if no_backward else list(GRADIENT_INPUTS))


def _projection(ctx: Context):
    """A scalar loss from an output: its dot product with a random tensor from a generator of its own (the context's
    stream is left where it was)."""
    gen = torch.Generator().manual_seed(ctx.cfg.seed)
    return lambda out: (out.float() * torch.randn(out.shape, generator=gen).to(out.device)).sum()


def side_by_side(ctx: Context, inputs: dict[str, torch.Tensor], gradients: bool = True) -> tuple[bool, bool | None]:
    """One eval forward of the special inputs side by side (samples need not be known apart: only finiteness is
    read) and, with `gradients`, a backward of a random projection of it into the input: (every output finite, the
    gradient finite at GRADIENT_INPUTS' samples; None where no gradient reaches the input or none was asked). (False,
    None) where they cannot run together, or that forward raises or is not finite: each then runs alone."""
    xs = list(inputs.values())
    if len(xs) < 2 or not ctx.batched(*xs, apart=False):
        return False, None
    ctx.step("special inputs side by side")
    if not gradients:
        out = forward_together(ctx, xs, apart=False)
        return out is not None and bool(torch.isfinite(out).all()), None
    outs, project = [], _projection(ctx)
    try:
        g = input_grad(ctx, torch.cat(xs), lambda out: project(outs.append(out) or out), train=False)
    except Exception as e:  # noqa: BLE001 - a probe that raises together says so alone
        if is_out_of_memory(e):
            raise
        return False, None
    if not outs or not all_finite(outs[0].detach()):
        return False, None
    if g is None:
        return True, None
    rows = dict(zip(inputs, g.split([x.shape[0] for x in xs])))
    return True, all(all_finite(rows[label]) for label in GRADIENT_INPUTS)


def nonfinite_gradients(ctx: Context, inputs: dict[str, torch.Tensor]) -> list[dict]:
    """The inputs (finite outputs all) whose eval backward of a random projection of the output, each alone, leaves
    a non-finite gradient at the input."""
    bad, project = [], _projection(ctx)
    for label, x in inputs.items():
        ctx.step(f"gradient of the {label} input")
        g = input_grad(ctx, x, project, train=False)
        if g is not None and not all_finite(g):
            bad.append({"input": label, "got": nonfinite_kind(g)})
    return bad
