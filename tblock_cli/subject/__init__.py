"""The block under test: `Subject` (a module and the one way tblock calls it), the built-in block (`builtin`), a user's
block from a SPEC (`loading`), the reference it is held against (`reference`), the decode protocol (`kvcache`),
Hugging Face layers (`hf/`), and the setup that builds any of them through one pipeline (`setup`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.errors import one_line

# A kernel whose backward this device lacks refuses any forward that records autograd (FlexAttention on the CPU and on
# MPS): such a block runs forward-only here.
NO_BACKWARD = re.compile(r"(does not|doesn't|cannot) support backward|backward (is )?not (supported|implemented)", re.I)


@dataclass
class Subject:
    """A module and the one way tblock calls it: `subject(x, pad_mask)` -> (B, T, d) tensor."""

    module: nn.Module
    name: str  # what to call it in output: "built-in pre-LN block" or the SPEC
    builtin: bool
    pad_keyword: str | None  # the forward keyword that takes a (B, T) padding mask, if any
    causal: bool  # whether the user said the block is causal (--causal)
    pad_means: str = "pad"  # what True means in the block's own mask: pad, or keep (HF, x-transformers)
    # rules a known family breaks on purpose (kind -> reason; "check.skip" -> reason): tblock's own knowledge of an
    # hf: family, or of the family a user block's config names (`model_type`: a T5 port holding a T5Config), never
    # read from the module under test (a user block's attribute of that name means nothing here)
    by_design: dict[str, str] = field(default_factory=dict)
    # [forwards, backwards] through this calling convention, shared with every `like` copy (checks.cost counts them
    # here, not with a module hook: a hook on the module turns off nn.TransformerEncoderLayer's fast path)
    passes: list | None = field(default=None, compare=False, repr=False)
    # builds the block anew from its factory: rebuild(seed, device) on "cpu" or "meta", in the run dtype, not moved;
    # None where the block was handed over as a module instance (nothing to build it from)
    rebuild: Callable[[int, str], nn.Module] | None = None
    # another instance from the very class or function the block was built from, on the meta device (rebuild runs the
    # block's file anew): None where there is none (a module instance, an hf: layer)
    sibling: Callable[[], nn.Module] | None = field(default=None, compare=False, repr=False)
    # the parameters that required grad as built, before tblock's first forward or mode switch (None: not noted)
    trained_at_build: frozenset | None = field(default=None, compare=False, repr=False)
    # parameters built narrower than most of the block's (a bfloat16 gain among float32 weights): (the block's dtype,
    # name -> its dtype), noted before tblock's cast to the run's dtype hides them (loading.narrow_parameters)
    narrow_at_build: tuple | None = field(default=None, compare=False, repr=False)
    # [the error of a forward that refused to record autograd on this device (NO_BACKWARD), then the count of forwards
    # run without it that wanted gradients], shared with every `like` copy: from the first such forward on, the block
    # runs under no_grad, and a check whose forwards wanted gradients is not judged (battery)
    backward_gap: list = field(default_factory=list, compare=False, repr=False)

    def __call__(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._call(x, pad_mask)
        if not self.backward_gap:
            try:
                return self._call(x, pad_mask)
            except NotImplementedError as e:
                if not NO_BACKWARD.search(str(e)):
                    raise
                self.backward_gap.extend([one_line(e), 0])
        # gradients wanted: of the input, or of the parameters in training (an eval trace only follows the values)
        self.backward_gap[1] += bool(x.requires_grad or self.module.training)
        with torch.no_grad():
            return self._call(x, pad_mask)

    def _call(self, x: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
        # pad_mask: (B, T) bool, True = padding, always; converted to the block's own convention here
        if pad_mask is None:
            out = self.module(x)
        elif self.pad_keyword is None:
            raise ValueError("this block's forward takes no padding mask")
        else:
            out = self.module(x, **{self.pad_keyword: pad_mask if self.pad_means == "pad" else ~pad_mask})
        out = first_tensor(out)
        if self.passes is not None:
            self.passes[0] += 1
            if out.requires_grad:
                out.register_hook(self._backward_seen)
        return out

    def _backward_seen(self, _grad) -> None:
        self.passes[1] += 1

    def ran(self, forwards: int) -> None:
        """Forwards over the block that did not go through this calling convention (cached decoding steps, each
        reading all the weights), counted with the rest."""
        if self.passes is not None:
            self.passes[0] += forwards

    def like(self, module: nn.Module) -> "Subject":
        """The same calling convention around another module (a float64 copy, a dropout-free copy)."""
        return Subject(module, self.name, self.builtin, self.pad_keyword, self.causal, self.pad_means, self.by_design,
                       self.passes, self.rebuild, backward_gap=self.backward_gap)


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"the forward returned {type(out).__name__}, not a tensor or a tuple/list starting with one")
