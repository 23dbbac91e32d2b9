"""The dropout check: in expectation over its random masks, a training forward computes what the eval forward does.

Inverted dropout keeps each element with probability 1 - p and scales it by 1 / (1 - p), so the mean over masks of
every dropped tensor is the tensor itself, and of everything computed linearly from it (attention probabilities times
values, an output projection, a residual add) too. torch's own dropouts (`F.dropout` and its kin, `nn.Dropout`, SDPA's
`dropout_p`, `nn.MultiheadAttention`'s) rescale by construction and are turned off, so what stays random is the block's
own code: masks it draws itself. Judged on each module whose training forward is still random (its inputs fixed to
what an eval forward gave it, and no random module inside it): there the spread of the outputs over masks is that
code's, and a mean that sits away from the eval output by a sizeable part of that spread is a mask that is not
rescaled, or rescaled twice."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed, passed, skipped
from tblock_cli.checks.training import all_modules, seeded, too_large
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import rel_diff, reseed, train_mode, zero_dropout
from tblock_cli.subject import first_tensor

# Training forwards per judged module. The mean's own noise is the spread / sqrt(MASKS) and is subtracted (the bias
# below is debiased), leaving the bias to within ~sqrt(2 / n) / MASKS for n independent draws behind the output. n is
# read from the samples (the participation ratio of their Gram matrix): elementwise masks give n ~ MASKS; a mask per
# sample (stochastic depth) gives n ~ the batch. Below FEW draws, MORE_MASKS forwards; below MIN_DRAWS, not judged.
# With the LIMIT below, a correct module's chance of an alarm is then under 1e-4 (chi-square tails at n = MIN_DRAWS).
MASKS = 64
MORE_MASKS = 256
FEW = 16
MIN_DRAWS = 4
BATCH = 8
# The squared bias of the mean over masks against the eval output, in units of the per-mask variance (summed over the
# output's elements). An unscaled mask at rate p gives p / (1 - p): 0.11 at p = 0.1, 0.053 at p = 0.05; measured on
# correct modules (d_model 64, p = 0.1): 0.0001-0.0024, a Post-LN block whose dropout is its own code 0.0024 (0.011 at
# p = 0.3), where the norm after the add bends the mean.
LIMIT = 0.04


class TorchDropoutOff(TorchFunctionMode):
    """torch's dropout functions as the identity, SDPA and `F.multi_head_attention_forward` with dropout_p 0: the
    randomness torch itself rescales, off. (A mode is not on inside the function it intercepts: the dropout inside
    multi_head_attention_forward is reached through its argument.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        where = _DROPOUT_P.get(func)
        if where is not None:
            if len(args) > where:
                args = args[:where] + (0.0,) + args[where + 1:]
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout})
_DROPOUT_P = {F.scaled_dot_product_attention: 4, F.multi_head_attention_forward: 10}  # dropout_p's position


def _clone(tree):
    """Arguments with every tensor detached and copied (a call may write into its inputs), containers kept."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, tree)


def _inputs(module: nn.Module, subject, x: torch.Tensor) -> dict[int, tuple]:
    """Each submodule's arguments at its first call in an eval forward of the block."""
    calls: dict[int, tuple] = {}

    def pre(m, args, kwargs):
        calls.setdefault(id(m), (_clone(args), _clone(kwargs)))

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in all_modules(module) if m is not module]
    try:
        with torch.no_grad(), train_mode(module, False):
            subject(x)
    finally:
        for h in hooks:
            h.remove()
    return calls


def check_dropout(ctx: Context) -> Outcome:
    """Catches: a dropout whose kept elements are not rescaled by 1 / (1 - p) (a hand-made mask `x * (rand >= p)`),
    or rescaled twice. With torch's own dropouts off, a training forward that still differs from the eval forward
    only while the block's dropout rate is above 0 (a rescale of its own on top of `F.dropout`'s, an eval forward
    scaled by 1 - p on top of inverted dropout); or, where the block draws masks itself (random training forwards
    that the rate's zeroing makes deterministic), the mean over 64 training forwards of the innermost random module,
    its inputs fixed to an eval forward's, more than 0.2 of the spread over masks away from its eval output (an
    unscaled mask at p = 0.1: 0.33); names that module. Randomness that stays at dropout 0 (gating noise, router
    jitter) is not judged"""
    if (large := too_large(ctx)) is not None:
        return large
    with seeded(ctx.device):  # every call below reseeds: the caller's random state is put back after
        return _check(ctx)


def _check(ctx: Context) -> Outcome:
    module = copy.deepcopy(ctx.subject.module)  # modules are called alone, many times, in train mode: a copy's state
    subject = ctx.subject.like(module)
    x = ctx.x(batch=max(ctx.cfg.batch, BATCH))  # a mask per sample (stochastic depth) needs samples to average over
    calls: dict[int, tuple] = {}
    names = {id(m): n for n, m in module.named_modules()}

    def run(m: nn.Module, train: bool, seed: int) -> torch.Tensor:
        reseed(seed)
        off = TorchDropoutOff() if train else contextlib.nullcontext()
        with torch.no_grad(), train_mode(module, False), train_mode(m, train), off:
            if m is module:
                return subject(x).float()
            args, kwargs = calls[id(m)]
            return first_tensor(m(*_clone(args), **_clone(kwargs))).float()

    ctx.step("the block's own randomness")
    try:
        want = run(module, False, 0)
    except Exception as e:  # noqa: BLE001 - a block built for fewer sequences (a cache of max_batch_size): the run's
        if is_out_of_memory(e) or x.shape[0] == ctx.cfg.batch:
            raise
        x = ctx.x()
        want = run(module, False, 0)
    try:
        one, two = run(module, True, 1), run(module, True, 2)
    except Exception as e:  # noqa: BLE001 - a block that does not run under a function mode (compiled code, say)
        if is_out_of_memory(e):
            raise
        return skipped("dropout.unsupported", error=one_line(e))
    if torch.equal(one, two):  # nothing random of the block's own: training must now be eval, or differ at any rate
        diff = rel_diff(one, want)
        if diff <= ctx.tol:
            return passed("dropout.torch_only", diff, diff=diff)
        zeroed = _at_rate_zero(ctx, module, x)
        # at rate 0 the block's own eval forward is the reference: an eval forward that reads the rate (a `* (1 - p)`
        # on top of inverted dropout) is the rate's doing too
        if zeroed is None or rel_diff(zeroed(1), zeroed(0, train=False)) > ctx.tol:
            return skipped("dropout.train_path", diff=diff)  # an eval-only path: train_eval's finding
        return failed("dropout.rescaled", diff, diff=diff)
    zeroed = _at_rate_zero(ctx, module, x)
    if zeroed is None or not torch.equal(zeroed(1), zeroed(2)):
        return skipped("dropout.other_noise")  # noise the dropout rate does not govern (gating noise, jitter)

    ctx.step("random modules")
    calls.update(_inputs(module, subject, x))
    random: dict[int, bool] = {id(module): True}
    for m in all_modules(module):
        if id(m) not in calls:
            continue
        try:
            random[id(m)] = not torch.equal(run(m, True, 1), run(m, True, 2))
        except Exception:  # noqa: BLE001 - a module that cannot be called alone (state its parent sets): not judged
            continue
    judged = [m for m in all_modules(module)
              if random.get(id(m)) and not any(random.get(id(c)) for c in all_modules(m) if c is not m)]
    worst, masks = (0.0, None, 0.0), MASKS
    seen = []
    for m in judged:
        name = names.get(id(m)) or type(m).__name__
        ctx.step(name)
        try:
            ref = run(m, False, 0)
            outs = torch.stack([run(m, True, 100 + i) for i in range(MASKS)])
            if outs.shape[1:] != ref.shape or not torch.isfinite(outs).all():
                continue
            if _draws(outs) < FEW:
                outs = torch.cat([outs, torch.stack([run(m, True, 100 + i) for i in range(MASKS, MORE_MASKS)])])
        except Exception as e:  # noqa: BLE001 - a module whose calls alone stop working (state it advances): not judged
            if is_out_of_memory(e):
                raise
            continue
        if _draws(outs) < MIN_DRAWS:
            continue
        mean, var = outs.mean(0), outs.var(0)
        spread = var.sum()
        bias2 = ((mean - ref).pow(2).sum() - spread / len(outs)) / spread
        direction = ((mean - ref) * ref).sum() / ref.pow(2).sum().clamp_min(1e-30)
        seen.append(name)
        if bias2.item() > worst[0] or worst[1] is None:
            worst = (bias2.item(), name, direction.item())
            masks = len(outs)
    if not seen:
        return skipped("dropout.unjudged")
    bias2, name, direction = worst
    facts = {"module": name, "bias": max(bias2, 0.0) ** 0.5, "limit": LIMIT ** 0.5, "masks": masks, "judged": seen,
             "shrinks": direction < 0}
    if bias2 > LIMIT:
        return failed("dropout.biased", round(facts["bias"], 3), **facts)
    return passed("dropout.unbiased", round(facts["bias"], 3), **facts)


def _draws(outs: torch.Tensor) -> float:
    """How many independent random draws the samples' spread reflects: the participation ratio tr(G)^2 / |G|^2 of
    the Gram matrix of the centred samples (elementwise masks: about the number of samples; one mask per batch
    element: about the batch)."""
    flat = outs.flatten(1).double()
    flat = flat - flat.mean(0)
    gram = flat @ flat.T
    norm = gram.pow(2).sum()
    return (gram.trace() ** 2 / norm).item() if norm > 0 else 0.0


def _at_rate_zero(ctx: Context, module: nn.Module, x: torch.Tensor):
    """(seed, train) -> the training forward (torch's dropouts off; train=False: the eval forward) of the block with
    its dropout rate at 0: rebuilt through its constructor with dropout=0 where it takes one, else with every dropout
    probability it keeps zeroed (modules, attributes named *drop* or `p`, its config's). None when neither is
    possible (nothing to zero)."""
    from tblock_cli.checks.structure import rebuilt_without_dropout

    rebuilt = rebuilt_without_dropout(ctx)
    target = rebuilt if rebuilt is not None else module
    subject = ctx.subject.like(target)

    if rebuilt is None:
        with zero_dropout(target) as changed, _rates_named_p(target) as more:
            if not changed and not more:
                return None

    def forward(seed: int, train: bool = True) -> torch.Tensor:
        reseed(seed)
        off = TorchDropoutOff() if train else contextlib.nullcontext()
        with zero_dropout(target), _rates_named_p(target), torch.no_grad(), train_mode(target, train), off:
            return subject(x).float()

    return forward


@contextlib.contextmanager
def _rates_named_p(module: nn.Module):
    """Float attributes named `p` strictly between 0 and 1 (a hand-written dropout's rate: `self.p`) at 0 for a while;
    yields how many. torch's dropout modules are zero_dropout's."""
    changed = []
    try:
        for m in all_modules(module):
            v = vars(m).get("p")
            if type(v) is float and 0 < v < 1 and not isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = 0.0
                changed.append((m, v))
        yield len(changed)
    finally:
        for m, v in changed:
            m.p = v
