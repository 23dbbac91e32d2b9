"""What every check draws on: the subject, sizes, a seeded generator, tolerances, and the probes checks share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tblock_cli.config import BlockConfig
from tblock_cli.loading import Subject
from tblock_cli.probes import train_mode

# Largest |difference| between two computations that should agree, relative to max(1, |reference|).
# float32 sums of a few hundred products carry ~1e-6 relative error; 1e-5 leaves a margin and is
# the tolerance issue #2 sets for the reference check. Half precisions have 10 (fp16) and 7 (bf16)
# mantissa bits: 2^-7 ~ 8e-3 and 2^-4 ~ 6e-2 cover a LayerNorm, an attention and an FFN in a row.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}


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
