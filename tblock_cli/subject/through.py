"""A model's own forward drives a span of its layers: tblock's hidden states swapped in at the first, the forward
stopped after the last. Shared by Hugging Face models (`hf/drive.py`) and any model over token ids (`driven.py`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class Done(BaseException):
    """Carries the last layer's output out of the model's forward (a BaseException: no model code catches it)."""

    def __init__(self, out):
        super().__init__()
        self.out = out


def first_output(out):
    """A layer's hidden states out of what it returns: a tensor, a tuple starting with one, or an HF output."""
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)


def drive(call: Callable[[], object], first: nn.Module, last: nn.Module, x: torch.Tensor,
          entered: Callable[[tuple, dict], None] | None = None):
    """`call()` (the model's forward on placeholders) with x in place of the hidden states `first` is given, stopped
    with `last`'s output, which is returned. `entered(args, kwargs)` sees what the model hands the first layer."""

    def swap_in(_m, args, kwargs):
        if entered is not None:
            entered(args, kwargs)
        h = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        # every argument that is the hidden states (funnel passes them as query, key and value)
        return tuple(x if a is h else a for a in args), {k: x if v is h else v for k, v in kwargs.items()}

    def stop(_m, _args, out):
        raise Done(first_output(out))

    hooks = [first.register_forward_pre_hook(swap_in, with_kwargs=True), last.register_forward_hook(stop)]
    try:
        call()
    except Done as done:
        return done.out
    finally:
        for h in hooks:
            h.remove()
    raise RuntimeError(f"the model's forward never reached {type(last).__name__}")
