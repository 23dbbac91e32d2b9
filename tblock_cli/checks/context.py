"""What every check draws on: the subject, sizes, a seeded generator, tolerances, and the probes checks share
(declared once here, memoised by `Context.probe`; checks never write the context)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tblock_cli.config import BlockConfig
from tblock_cli.probes import TOLERANCE, changed, grad_of, grads_kept, state_key, train_mode
from tblock_cli.subject import Subject

# Probes of one check that need not see each other run as one forward of their concatenated batch when the block
# is known to keep samples apart (the batch check passed) and the batch stays this small: at a 7B-size layer a
# forward of 20 tokens costs 0.45 s and one of 80 tokens 0.87 s, most of it reading the weights once.
BATCHED_TOKENS = 512
# The seed offset of a stream a check draws its redrawn parameters from (own_gen): ctx.gen, and so every input the
# checks after it draw, stays where it was.
OWN_STREAM = 17


# What invalidates a probe's memo.
ONCE = "nothing: a property of the block, computed once per battery"
STATE = "the module's state (state_key, taken in eval mode): a forward that wrote a buffer or a parameter"


@dataclass(frozen=True)
class Probe:
    """A probe several checks read: computed by whichever check asks first, memoised on the context (`Context.probe`,
    the only writer), computed again when what invalidates it changed."""

    name: str
    costs: str
    invalidated_by: str = ONCE
    failure_kept: bool = False  # a raise is remembered and raised again to later askers (else the next one retries)


# Every shared probe, declared once; where it is computed is named after the colon.
STANDARD = Probe("standard_forward", "one eval forward of the standard input: context.py", STATE)
TRAINING_BACKWARD = Probe("training_backward", "one train forward + backward: gradients.train_backward")
TRAINING_INPUT = Probe("training_input", "nothing: noted by the training backward's forward (even when its backward raises)")
CAUSAL_BY_ITSELF = Probe("causal_by_itself", "one eval backward through the outputs up to t/2: mixing.causal_by_itself")
DATAFLOW = Probe("dataflow", "one traced forward of the probe input: context.py")
IDENTICAL_SCORES = Probe("identical_scores", "one traced eval forward of identical tokens: positions.identical_scores",
                         failure_kept=True)
OWN_CLAIMS = Probe("own_claims", "no forward: the block's attributes and configs read: training.block_claims")
PROBES = (STANDARD, TRAINING_BACKWARD, TRAINING_INPUT, CAUSAL_BY_ITSELF, DATAFLOW, IDENTICAL_SCORES, OWN_CLAIMS)


@dataclass(frozen=True)
class Standard:
    """The standard input (batch, seq, d), its eval output, and whether that forward wrote into its input."""

    x: torch.Tensor
    y: torch.Tensor
    changed_input: tuple[bool, float]


@dataclass(frozen=True)
class _Raised:
    error: BaseException


@dataclass
class Context:
    """The subject and what every check draws on: sizes, dtype, a seeded generator, the shared probes' memo."""

    subject: Subject
    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    gen: torch.Generator = field(init=False)
    unmet: dict = field(default_factory=dict)  # need -> the check that left it unmet, filled as the battery runs
    sharding: object = None  # distributed.Sharding of check --tp / --fsdp, or None
    declaration: object = None  # spec.declare.Declaration: what the block claims to be (--like, --expect), or None
    progress: Callable[[str, str | None], None] | None = None  # hears (check, probe) on long checks
    current: str = ""  # the check running now, for progress
    met: set = field(default_factory=set)  # needs established by a check that passed, filled as the battery runs
    memo: dict = field(default_factory=dict)  # probe name -> (the key it was computed at, its value): see probe()
    # (check, {switch: [before, after]}) for each check whose run changed torch's process-wide switches (the battery
    # notes them and puts them back: checks.globalstate)
    state_changes: list = field(default_factory=list)
    # each trainable parameter's fingerprint (forward.fingerprint) as the battery starts: its forwards must leave them
    params_at_start: dict = field(default_factory=dict)
    # the parameters that required grad as the block was built (Subject.trained_at_build), else as the battery started
    trained_at_start: set = field(default_factory=set)

    def step(self, detail: str) -> None:
        """Say which probe of the running check starts (a progress line on big layers)."""
        if self.progress is not None:
            self.progress(self.current, detail)

    def __post_init__(self):
        self.gen = torch.Generator().manual_seed(self.cfg.seed)

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def own_gen(self) -> torch.Generator:
        """A fresh generator of the run's seed offset by OWN_STREAM: draws a check makes from it move nothing else."""
        return torch.Generator().manual_seed(self.cfg.seed + OWN_STREAM)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen) * scale
        return x.to(device=self.device, dtype=self.dtype)

    def x(self, batch: int | None = None, seq: int | None = None) -> torch.Tensor:
        return self.randn(batch or self.cfg.batch, seq or self.cfg.seq, self.cfg.d_model)

    def probe(self, probe: Probe, compute: Callable[[], object]):
        """`probe`'s value: memoised, or computed now by `compute` (whichever check asks first pays)."""
        key = self._key(probe)
        got = self.memo.get(probe.name)
        if got is not None and got[0] == key:
            if isinstance(got[1], _Raised):
                raise got[1].error
            return got[1]
        try:
            value = compute()
        except Exception as e:
            if probe.failure_kept:
                self.memo[probe.name] = (key, _Raised(e))
            raise
        self.memo[probe.name] = (self._key(probe), value)  # the key after: the forward may have written state
        return value

    def noted(self, probe: Probe):
        """What a probe noted on its way, or None (TRAINING_INPUT: the training forward's input change)."""
        got = self.memo.get(probe.name)
        return None if got is None else got[1]

    def note(self, probe: Probe, value) -> None:
        """For a probe's own computation only: a fact it saw on its way (kept even when it raises later)."""
        self.memo[probe.name] = (None, value)

    def _key(self, probe: Probe):
        if probe.invalidated_by is not STATE:
            return None
        # The key is taken in the mode the forward runs in: the modes a caller left (an HF layer's train() also sets
        # its model's, which kept_modes does not see) are no state this forward reads.
        with train_mode(self.subject.module, False):
            return state_key(self.subject.module)

    def standard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The standard input (batch, seq, d) and its eval output: one forward shared by the checks that read it,
        computed again only when the module's state changed since. The input is drawn once (by the first forward
        that succeeds) and kept; the forward gets a copy of it, and whether it wrote into it is kept for input_unchanged."""
        s = self.standard_forward()
        return s.x, s.y

    def standard_forward(self) -> Standard:
        def compute() -> Standard:
            before = self.memo.get(STANDARD.name)
            x0 = before[1].x if before is not None else self.x()
            xin = x0.clone()
            with train_mode(self.subject.module, False), torch.no_grad():
                y0 = self.subject(xin, None)
            return Standard(x0, y0, changed(xin, x0))
        return self.probe(STANDARD, compute)

    def batched(self, *xs: torch.Tensor, apart: bool = True) -> bool:
        """Whether probes xs (each (B, T, d)) may run as one forward: small, and samples known independent where each
        probe's outputs are read apart (apart=False: only a property of all of them, rerun alone where it fails)."""
        return (not apart or "independent" in self.met) and sum(x.shape[0] * x.shape[1] for x in xs) <= BATCHED_TOKENS

    def dataflow(self):
        """The block's traced anatomy on the probe input, computed once (ffn_share, attention and others share it)."""
        from tblock_cli.anatomy import trace

        return self.probe(DATAFLOW, lambda: trace(self.subject.module, self.subject, self.x(), self.cfg.d_model))


def eval_forward(ctx: Context, x: torch.Tensor, pad_mask: torch.Tensor | None = None, subject: Subject | None = None) -> torch.Tensor:
    s = subject or ctx.subject
    with train_mode(s.module, False), torch.no_grad():
        return s(x.clone(), pad_mask)  # a clone: a block that mutates its input spoils no other check


def forward_together(ctx: Context, xs: list[torch.Tensor], masks: list | None = None, apart: bool = True) -> torch.Tensor | None:
    """The eval output of one forward of several inputs' concatenation, where ctx.batched(apart=...) allows; None where
    it does not, or where that forward raises (a probe that raises alone says so when it runs alone)."""
    from tblock_cli.errors import is_out_of_memory

    masks = masks if masks is not None else [None] * len(xs)
    if len(xs) < 2 or not ctx.batched(*xs, apart=apart) or not (all(m is None for m in masks) or all(m is not None for m in masks)):
        return None
    try:
        return eval_forward(ctx, torch.cat(xs), None if masks[0] is None else torch.cat(masks))
    except Exception as e:  # noqa: BLE001
        if is_out_of_memory(e):
            raise
        return None


def eval_together(ctx: Context, xs: list[torch.Tensor], masks: list | None = None) -> list[torch.Tensor] | None:
    """Eval outputs of several inputs from one forward of their concatenation (forward_together), split back per input;
    None where that forward does not run, or its output does not lead with the batch."""
    out = forward_together(ctx, xs, masks)
    sizes = [x.shape[0] for x in xs]
    if out is None or out.ndim == 0 or out.shape[0] != sum(sizes):
        return None
    return list(out.split(sizes))


def eval_forwards(ctx: Context, xs: list[torch.Tensor], masks: list | None = None) -> list[torch.Tensor]:
    """Eval outputs of several inputs: one forward of their concatenation where ctx.batched allows, else one each."""
    masks = masks if masks is not None else [None] * len(xs)
    return eval_together(ctx, xs, masks) or [eval_forward(ctx, x, m) for x, m in zip(xs, masks)]


def projected(ctx: Context, part: torch.Tensor) -> torch.Tensor:
    """A scalar loss from part of an output: its dot product with a fresh random tensor of its shape."""
    return (part.float() * ctx.randn(*part.shape).float()).sum()


def input_grad(ctx: Context, x: torch.Tensor, loss_of: Callable, train: bool = True, pad_mask=None) -> torch.Tensor | None:
    """d loss_of(out) / d x, in train (or eval) mode with grad enabled (through a reentrant checkpoint too: grad_of)."""
    x = x.detach().clone().requires_grad_(True)
    with train_mode(ctx.subject.module, train), torch.enable_grad(), grads_kept(ctx.subject.module):
        out = ctx.subject(x.clone(), pad_mask)
        loss = loss_of(out)
        if not loss.requires_grad:
            return None
        return grad_of(loss, x)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite, in one reducing pass and no tensor of t's size: NaN propagates to both the
    minimum and the maximum, an inf shows in one of them (torch.isfinite(t).all() first writes a bool per element:
    25x slower on a 7B-size layer's 45M-element gradient)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    low, high = t.detach().aminmax()
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def nonfinite_kind(t: torch.Tensor) -> str:
    kinds = [k for k, present in (("NaN", torch.isnan(t).any()), ("inf", torch.isinf(t).any())) if present]
    return "/".join(kinds) or "non-finite values"
