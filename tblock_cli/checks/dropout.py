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
import math

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from tblock_cli.checks.context import Context
from tblock_cli.checks.draws import distinct_draws, replaced_by_constant
from tblock_cli.checks.dropout_places import (
    attention_ignored,
    attention_rate_differs,
    never_applied,
    on_scores,
    on_stream,
    residual_ignored,
)
from tblock_cli.checks.result import Outcome, failed, passed, skipped
from tblock_cli.checks.training import all_modules, seeded, too_large
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import TorchDropoutOff, module_copy, rel_diff, reseed, set_dropout, train_mode
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
# The other rate the block is built again at, to see which of its dropouts' rates follow the argument.
OTHER_RATE = 0.2
# Training forwards on a batch of one sample repeated, where masks shared across the batch give every copy the same
# output and a new one every forward; a decision per forward for the whole batch (LayerDrop) repeats among its few
# outcomes well within 16 forwards (two branches dropped at p = 0.1: 16 draws all distinct never happen).
SHARED_RUNS = 16
# Where two seeded training forwards agree and differ from eval, the rate they are tried again at, and how many more
# seeds: a draw kept with probability 1 - p per branch shows at 0.5 within 8 forwards (two branches: 1 - 0.25^8).
RAISED_RATE = 0.5
RAISED_RUNS = 8


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
    unscaled mask at p = 0.1: 0.33); names that module. Also: a dropout on the residual stream (with every dropout
    dropping all, tr(J)/n below a quarter of eval's: the identity path cut), a rate that falls as the dropout argument
    rises (`nn.Dropout(1 - p)`), one activation mask for the whole batch (identical samples get identical, ever-new
    outputs; a draw without the batch axis), a dropout on attention's scores before the softmax (in training some
    scores exactly 0 and the rest the eval scores times one factor, 1 / (1 - p): a zeroed score is not a dropped key).
    Randomness that stays at dropout 0 (gating noise, router jitter) is not judged. A **warning** where a block built
    with a rate above 0 keeps an nn.Dropout and drops nothing in training (the rate ignored: defined, never called).
    A block that says it drops attention's probabilities (`attention_dropout`, `attn_pdrop`, `attn_drop`, ...) at a
    rate above 0 and whose training forward drops none of them (SDPA called with dropout_p 0) or drops them at other
    rates only (a constant where the argument was meant), and one that says it
    drops each sublayer's output (`resid_pdrop`, `hidden_dropout_prob`, `proj_drop`, ...) and drops no tensor of the
    stream's size, or drops them at other rates only, or only one while its sublayers run in a row (the FFN reads
    attention's output: one of the two outputs undropped)"""
    if (large := too_large(ctx)) is not None:
        return large
    with seeded(ctx.device):  # every call below reseeds: the caller's random state is put back after
        return _check(ctx)


def _check(ctx: Context) -> Outcome:
    module = module_copy(ctx.subject.module)  # modules are called alone, many times, in train mode: a copy's state
    subject = ctx.subject.like(module)
    x = ctx.x(batch=max(ctx.cfg.batch, BATCH))  # a mask per sample (stochastic depth) needs samples to average over
    calls: dict[int, tuple] = {}
    names = {id(m): n for n, m in module.named_modules()}

    def run(m: nn.Module, train: bool, seed: int, off: TorchDropoutOff | None = None, inp=None) -> torch.Tensor:
        reseed(seed)
        off = (off or TorchDropoutOff()) if train else contextlib.nullcontext()
        with torch.no_grad(), train_mode(module, False), train_mode(m, train), off:
            if m is module:
                return subject(x if inp is None else inp).float()
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
    asked = TorchDropoutOff()
    try:
        one, two = run(module, True, 1, asked), run(module, True, 2)
    except Exception as e:  # noqa: BLE001 - a block that does not run under a function mode (compiled code, say)
        if is_out_of_memory(e):
            raise
        return skipped("dropout.unsupported", error=one_line(e))
    if asked.rates:
        ctx.step("the scores under dropout")
        if (found := on_scores(ctx, subject, x)) is not None:
            return found
        ctx.step("the identity path with every dropout dropping all")
        if (found := on_stream(ctx, run, module, x)) is not None:
            return found
    if asked.rates or asked.attention_rates:
        ctx.step("the rates at another dropout")
        if (found := _rates(ctx, asked, x)) is not None:
            return found
    if torch.equal(one, two):  # nothing random of the block's own: training must now be eval, or differ at any rate
        diff = rel_diff(one, want)
        if diff <= ctx.tol:
            return (attention_ignored(ctx, module, asked, x) or attention_rate_differs(ctx, module, asked, x)
                    or residual_ignored(ctx, module, asked, x)
                    or never_applied(ctx, module, asked, diff) or passed("dropout.torch_only", diff, diff=diff))
        # a decision per forward for the whole batch (batch-mode stochastic depth) can keep everything at both seeds:
        # at a raised rate such draws show, and draws too rare at the block's rate are not judged
        raised = _at_rate(ctx, module, x, RAISED_RATE)
        if raised is not None and any(not torch.equal(raised(1), raised(s)) for s in range(2, 2 + RAISED_RUNS)):
            return skipped("dropout.rare_draws", diff=diff, rate=RAISED_RATE)
        zeroed = _at_rate(ctx, module, x)
        # at rate 0 the block's own eval forward is the reference: an eval forward that reads the rate (a `* (1 - p)`
        # on top of inverted dropout) is the rate's doing too
        if zeroed is None or rel_diff(zeroed(1), zeroed(0, train=False)) > ctx.tol:
            return skipped("dropout.train_path", diff=diff)  # an eval-only path: train_eval's finding
        return failed("dropout.rescaled", diff, diff=diff)
    zeroed = _at_rate(ctx, module, x)
    if zeroed is None or not torch.equal(zeroed(1), zeroed(2)):
        return skipped("dropout.other_noise")  # noise the dropout rate does not govern (gating noise, jitter)
    ctx.step("masks across the batch")
    if (found := _shared(ctx, run, module, x)) is not None:
        return found

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
    seen, replaced = [], []
    for m in judged:
        name = names.get(id(m)) or type(m).__name__
        ctx.step(name)
        try:
            ref = run(m, False, 0)
            outs = torch.stack([run(m, True, 100 + i) for i in range(MASKS)])
            if outs.shape[1:] != ref.shape or not torch.isfinite(outs).all():
                continue
            if distinct_draws(outs) < FEW:
                outs = torch.cat([outs, torch.stack([run(m, True, 100 + i) for i in range(MASKS, MORE_MASKS)])])
        except Exception as e:  # noqa: BLE001 - a module whose calls alone stop working (state it advances): not judged
            if is_out_of_memory(e):
                raise
            continue
        if distinct_draws(outs) < MIN_DRAWS:
            continue
        if replaced_by_constant(outs, ref) and _replaced_without_biases(m, run, len(outs)):
            replaced.append(name)
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
        return skipped("dropout.unjudged", replaced=replaced)
    bias2, name, direction = worst
    facts = {"module": name, "bias": max(bias2, 0.0) ** 0.5, "limit": LIMIT ** 0.5, "masks": masks, "judged": seen,
             "shrinks": direction < 0, "replaced": replaced}
    if bias2 > LIMIT:
        return failed("dropout.biased", round(facts["bias"], 3), **facts)
    return passed("dropout.unbiased", round(facts["bias"], 3), **facts)


def _replaced_without_biases(m: nn.Module, run, draws: int) -> bool:
    """The replacement seen again with every bias in m zeroed: a learned null value (an embedding table's row) stays,
    while rows a mask zeroed before a biased projection (fc(h * mask) without the rescale: fc's bias) become zeros."""
    biases = [p for n, p in m.named_parameters() if n.rpartition(".")[2] == "bias"]
    kept = [p.detach().clone() for p in biases]
    try:
        with torch.no_grad():
            for p in biases:
                p.zero_()
        ref = run(m, False, 0)
        return replaced_by_constant(torch.stack([run(m, True, 100 + i) for i in range(draws)]), ref)
    finally:
        with torch.no_grad():
            for p, v in zip(biases, kept):
                p.copy_(v)


def _rates(ctx: Context, asked: TorchDropoutOff, x: torch.Tensor) -> Outcome | None:
    """A rate that falls where the block's dropout argument rises (`nn.Dropout(1 - dropout)`: the rate read as a
    keep probability): the block built again through its constructor at another rate, and the rates its dropouts
    are asked for in a training forward compared. A rate that stays (a hard-coded one) or rises with the argument
    (scaled by depth, warmed up) is not judged."""
    from tblock_cli.checks.structure import rebuilt_with_dropout
    from tblock_cli.subject.loading import ALIASES, constructed_arguments

    built = constructed_arguments(ctx.subject.module)
    p0 = next((built[k] for k in ALIASES["dropout"] if isinstance(built.get(k), float)), ctx.cfg.dropout)
    p1 = OTHER_RATE if abs(p0 - OTHER_RATE) > 1e-9 else OTHER_RATE + 0.1
    rebuilt = rebuilt_with_dropout(ctx, p1)
    if rebuilt is None:
        return None
    other = TorchDropoutOff()
    try:
        reseed(1)
        with torch.no_grad(), train_mode(rebuilt, True), other:
            ctx.subject.like(rebuilt)(x)
    except Exception as e:  # noqa: BLE001 - a rebuilt block that does not run: not judged
        if is_out_of_memory(e):
            raise
        return None
    # a rate that falls as the argument rises (1 - p): rates that follow it by a factor or a schedule (depth-scaled
    # stochastic depth, a warm-up) rise with it, and a fixed one stays
    rises = p1 > p0
    if len(asked.calls) == len(other.calls):  # call by call
        moved = [(a, b) for a, b in zip(asked.calls, other.calls) if not _same(a, b) and (b > a) != rises]
        ran, ran_other = sorted({a for a, _ in moved}), sorted({b for _, b in moved})
    else:  # dropouts that run only at some rates: the one rate each side has alone, if it fell
        alone, alone_other = set(asked.calls) - set(other.calls), set(other.calls) - set(asked.calls)
        falls = len(alone) == len(alone_other) == 1 and (min(alone_other) > min(alone)) != rises
        ran, ran_other = (sorted(alone), sorted(alone_other)) if falls else ([], [])
    if ran and ran_other:
        return failed("dropout.rate", ran[0], asked=p0, ran=ran, other=p1, other_ran=ran_other)
    return None


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)


def _shared(ctx: Context, run, module: nn.Module, x: torch.Tensor) -> Outcome | None:
    """One mask for the whole batch (a mask drawn (1, T, C) for batch-first tensors, as a sequence-first locked
    dropout draws it): on a batch of one sample repeated, every training forward gives every copy the same output,
    and no two forwards the same, and a random draw has the sequence's length among its sizes but not the batch's
    first. A copy that differs from the first clears it at once (masks drawn per sample); an outcome seen before
    clears it too (a decision per forward for the whole batch: LayerDrop, torchvision's batch-mode stochastic depth
    take a few values); so does a mask drawn for a weight (DropConnect, Mixout: shared by the batch by design)."""
    B, T = x.shape[0], x.shape[1] if x.ndim > 2 else 0
    sizes = {d for p in module.parameters() for d in p.shape}
    if B < 2 or T in (0, 1, B) or T in sizes:  # the sequence's length must tell an activation's mask from a weight's
        return None
    same = x[:1].expand_as(x).contiguous()
    outs: list[torch.Tensor] = []
    draws = RandomDraws()
    for i in range(SHARED_RUNS):
        with draws if i == 0 else contextlib.nullcontext():
            out = run(module, True, 300 + i, None, same)
        if out.shape[:1] != x.shape[:1] or any(rel_diff(out[b], out[0]) > ctx.tol for b in range(1, len(out))):
            return None
        if any(rel_diff(out[0], o) <= ctx.tol for o in outs):
            return None
        outs.append(out[0])
    masks = sorted({s for s in draws.shapes if T in s and s[0] != B})
    if not masks:
        return None
    return failed("dropout.shared", SHARED_RUNS, forwards=SHARED_RUNS, batch=B, shapes=[list(s) for s in masks])


class RandomDraws(TorchFunctionMode):
    """Notes the shape of every tensor a random function makes or fills."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _RANDOM and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


_RANDOM = frozenset({torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
                     torch.bernoulli, torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
                     torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_})


def _at_rate(ctx: Context, module: nn.Module, x: torch.Tensor, rate: float = 0.0):
    """(seed, train) -> the training forward (torch's dropouts off; train=False: the eval forward) of the block with
    its dropout rate at `rate`: rebuilt through its constructor with that dropout where it takes one, else with every
    dropout probability it keeps set to it (modules, attributes named *drop* or `p`, its config's). None when
    neither is possible (no rate to set)."""
    from tblock_cli.checks.structure import rebuilt_with_dropout

    rebuilt = rebuilt_with_dropout(ctx, rate)
    target = rebuilt if rebuilt is not None else module
    subject = ctx.subject.like(target)

    if rebuilt is None:
        with set_dropout(target, rate) as changed, _rates_named_p(target, rate) as more:
            if not changed and not more:
                return None

    def forward(seed: int, train: bool = True) -> torch.Tensor:
        reseed(seed)
        off = TorchDropoutOff() if train else contextlib.nullcontext()
        with set_dropout(target, rate), _rates_named_p(target, rate), torch.no_grad(), train_mode(target, train), off:
            return subject(x).float()

    return forward


@contextlib.contextmanager
def _rates_named_p(module: nn.Module, rate: float = 0.0):
    """Float attributes named `p` strictly between 0 and 1 (a hand-written dropout's rate: `self.p`) at `rate` for a
    while; yields how many. torch's dropout modules are set_dropout's."""
    changed = []
    try:
        for m in all_modules(module):
            v = vars(m).get("p")
            if type(v) is float and 0 < v < 1 and not isinstance(m, nn.modules.dropout._DropoutNd):
                m.p = rate
                changed.append((m, v))
        yield len(changed)
    finally:
        for m, v in changed:
            m.p = v
