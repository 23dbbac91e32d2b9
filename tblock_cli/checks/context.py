"""What every check draws on: the subject, sizes, a seeded generator, tolerances, and the probes checks share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tblock_cli.config import BlockConfig
from tblock_cli.loading import Subject
from tblock_cli.probes import TOLERANCE, changed, state_key, train_mode

# Probes of one check that need not see each other run as one forward of their concatenated batch when the block
# is known to keep samples apart (the batch check passed) and the batch stays this small: at a 7B-size layer a
# forward of 20 tokens costs 0.45 s and one of 80 tokens 0.87 s, most of it reading the weights once.
BATCHED_TOKENS = 512


@dataclass
class Context:
    """The subject and what every check draws on: sizes, dtype, a seeded generator, shared probes."""

    subject: Subject
    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    gen: torch.Generator = field(init=False)
    unmet: dict = field(default_factory=dict)  # need -> the check that left it unmet, filled as the battery runs
    backward: tuple | None = None  # (x.grad, {name: grad_state}) of one train-mode backward, once computed
    causal_itself: bool | None = None  # outputs ignore later positions without --causal, once computed
    _dataflow: object = None
    sharding: object = None  # distributed.Sharding of check --tp / --fsdp, or None
    progress: Callable[[str, str | None], None] | None = None  # hears (check, probe) on long checks
    current: str = ""  # the check running now, for progress
    met: set = field(default_factory=set)  # needs established by a check that passed, filled as the battery runs
    first_step: tuple | None = None  # (x, state_key) right after the training backward: train_state's first step
    # (changed, rel. diff) of the input the training forward / the standard eval forward got, once run: written into?
    train_changed_input: tuple[bool, float] | None = None
    eval_changed_input: tuple[bool, float] | None = None
    _standard: list = field(default_factory=lambda: [None, None, None])  # x0, y0 and the state key y0 was computed at
    identical_scores: list | None = None  # per attention call, its scores captured on identical tokens (relative)

    def step(self, detail: str) -> None:
        """Say which probe of the running check starts (a progress line on big layers)."""
        if self.progress is not None:
            self.progress(self.current, detail)

    def __post_init__(self):
        self.gen = torch.Generator().manual_seed(self.cfg.seed)

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen) * scale
        return x.to(device=self.device, dtype=self.dtype)

    def x(self, batch: int | None = None, seq: int | None = None) -> torch.Tensor:
        return self.randn(batch or self.cfg.batch, seq or self.cfg.seq, self.cfg.d_model)

    def standard(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The standard input (batch, seq, d) and its eval output: one forward shared by the checks that read it,
        computed again only when the module's state changed since (state_key). The forward gets a copy of x0, not a
        clone of a clone: whether it wrote into its input is kept for input_unchanged."""
        x0, y0, key = self._standard
        if x0 is None:
            x0 = self.x()
        module = self.subject.module
        # The key is taken in the mode the forward runs in: the modes a caller left (an HF layer's train() also sets
        # its model's, which kept_modes does not see) are no state this forward reads.
        with train_mode(module, False):
            now = state_key(module)
            if y0 is None or key != now:
                xin = x0.clone()
                with torch.no_grad():
                    y0 = self.subject(xin, None)
                self.eval_changed_input = changed(xin, x0)
                now = state_key(module)
        self._standard = [x0, y0, now]
        return x0, y0

    def batched(self, *xs: torch.Tensor, apart: bool = True) -> bool:
        """Whether probes xs (each (B, T, d)) may run as one forward: small, and samples known independent where each
        probe's outputs are read apart (apart=False: only a property of all of them, rerun alone where it fails)."""
        return (not apart or "independent" in self.met) and sum(x.shape[0] * x.shape[1] for x in xs) <= BATCHED_TOKENS

    def dataflow(self):
        """The block's traced anatomy on the probe input, computed once (ffn_share and attention share it)."""
        if self._dataflow is None:
            from tblock_cli.anatomy import trace

            self._dataflow = trace(self.subject.module, self.subject, self.x(), self.cfg.d_model)
        return self._dataflow


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
    """d loss_of(out) / d x, in train (or eval) mode with grad enabled."""
    x = x.detach().clone().requires_grad_(True)
    with train_mode(ctx.subject.module, train), torch.enable_grad():
        out = ctx.subject(x.clone(), pad_mask)
        loss = loss_of(out)
        if not loss.requires_grad:
            return None
        (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return g


def nonfinite_kind(t: torch.Tensor) -> str:
    kinds = [k for k, present in (("NaN", torch.isnan(t).any()), ("inf", torch.isinf(t).any())) if present]
    return "/".join(kinds) or "non-finite values"
