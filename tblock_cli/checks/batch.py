"""The batch check: samples in a batch do not reach each other, but through the statistics torch's BatchNorm shares in
training by design."""

from __future__ import annotations

import contextlib

import torch

from tblock_cli.checks.context import Context, eval_forward, input_grad, projected
from tblock_cli.checks.result import Outcome, failed, passed
from tblock_cli.probes import f64, grads_kept, rel_diff, residual_gain, train_mode

# identity_share above which a BatchNorm reads the residual stream itself, where a LayerNorm would (a Pre-LN block's
# stream before its FFN: ~1 at init, like residual's tr(J)/n); a convolution module's BatchNorm reads ~0.
STREAM_SHARE = 0.5


def check_batch(ctx: Context) -> Outcome:
    """Catches: a sample alone differs from itself in the batch (eval), or sample 0's output has a gradient w.r.t.
    other samples (train: a batch mean); not torch's BatchNorm's batch statistics, which couple the samples in
    training by design (Conformer's convolution module, LeViT): with them normalising by their running statistics,
    no cross-sample gradient may remain; a BatchNorm that reads the residual stream itself (a LayerNorm's place) is
    no such design"""
    B = max(2, ctx.cfg.batch)
    x, out = ctx.standard() if ctx.cfg.batch >= 2 else (ctx.x(B), None)
    out = eval_forward(ctx, x) if out is None else out
    worst = max(rel_diff(eval_forward(ctx, x[i : i + 1])[0], out[i]) for i in range(B))
    if worst > ctx.tol:
        return failed("batch.leak", worst, diff=worst, limit=ctx.tol)
    # Train mode too (dropout, batch statistics): sample 0's output must not depend on the others.
    sample0 = lambda out: projected(ctx, out[0])  # noqa: E731 - the same loss twice below
    g = input_grad(ctx, x, sample0)
    if g is not None and g[1:].any():
        leak = f64(g[1:]).abs().max().item()
        norms = batch_norms(ctx.subject.module)
        on_stream = [n for m, n in norms.items() if identity_share(ctx, x, m) > STREAM_SHARE]
        if norms and not on_stream:
            with running_statistics(norms):
                g = input_grad(ctx, x, sample0)
            if g is None or not g[1:].any():
                return passed("batch.batch_norm", worst, diff=worst, norms=sorted(norms.values()), gradient=leak)
        return failed("batch.leak_train", leak, gradient=leak, stream_norms=sorted(on_stream))
    return passed("batch.independent", worst, diff=worst)


def identity_share(ctx: Context, x: torch.Tensor, m: torch.nn.Module) -> float:
    """tr(J)/n of the block's input -> module m's input (laid out as the block's: (B, T, C), or (B, C, T) transposed),
    in eval (probes.residual_gain, one probe): ~1 where m reads the residual stream itself (the input plus what
    sublayers added), ~0 where it reads a sublayer's own features (a convolution's output); 0 where its input has
    another shape. One forward and one backward."""
    def read_by_m(inp: torch.Tensor) -> torch.Tensor:
        seen: list = []
        handle = m.register_forward_pre_hook(lambda _m, args: seen.append(args[0]) if args else None)
        try:
            ctx.subject(inp)
        finally:
            handle.remove()
        u = seen[0] if seen and isinstance(seen[0], torch.Tensor) else None
        if u is not None and u.shape != inp.shape and u.ndim == 3 and u.transpose(1, 2).shape == inp.shape:
            u = u.transpose(1, 2)
        return u if u is not None and u.shape == inp.shape else inp * 0

    module = ctx.subject.module
    with train_mode(module, False), grads_kept(module):
        return residual_gain(read_by_m, x, ctx.own_gen(), probes=1)


def batch_norms(module: torch.nn.Module) -> dict:
    """torch's BatchNorm modules inside -> their names: in training they normalise over the batch by design."""
    return {m: name or "(root)" for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}


@contextlib.contextmanager
def running_statistics(norms: dict):
    """The BatchNorms normalise with their running statistics while the block trains (each set to eval as it runs;
    the train-mode run's own flags are put back by train_mode): what remains of a cross-sample gradient is not
    theirs."""
    def to_eval(m, _args):
        m.training = False

    handles = [m.register_forward_pre_hook(to_eval) for m in norms]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
