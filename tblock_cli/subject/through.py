"""A model's own forward drives a span of its layers: tblock's hidden states swapped in at the first, the forward
stopped after the last. Shared by Hugging Face models (`hf/drive.py`) and any model over token ids (`driven.py`)."""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import UPDATE_SHARE, update_share

# Positions of the causal probe: enough for a later position to exist after an earlier one.
PROBE_T = 4
# Relative change of earlier outputs that still counts as "unchanged" when a later token changes: float32
# rounding of a masked-out position is exactly 0 in every decoder measured; 1e-6 leaves rounding room.
CAUSAL_TOL = 1e-6
# Keyword names of position information a model hands its layers (rotary cos/sin, ALiBi, relative biases; funnel
# packs them into attention_inputs; litgpt hands its blocks cos and sin).
POSITION_KEYS = ("position_embeddings", "position_bias", "alibi", "rotary_pos_emb", "rel_embeddings",
                 "relative_pos", "sinusoidal_pos", "freqs_cis", "attention_inputs", "cos", "sin", "rope_cache")


class Done(BaseException):
    """Carries the last layer's output out of the model's forward (a BaseException: no model code catches it)."""

    def __init__(self, out):
        super().__init__()
        self.out = out


def raised_before_layer(e: BaseException) -> bool:
    """Whether a model's forward raised e before it handed the span its hidden states: its own plumbing refused the
    input (nanochat asserts T > 1 in training; a positional convolution too short for one token), not the layers."""
    return getattr(e, "_tblock_before_layer", False)


def first_output(out):
    """A layer's hidden states out of what it returns: a tensor, a tuple starting with one, or an HF output."""
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)


def _bound_to(fn) -> object:
    """The object a callable is bound to, through functools.partial: `layer.__call__`, `partial(super().__call__)`,
    `partial(forward, layer)`."""
    while isinstance(fn, functools.partial):
        if fn.args and not hasattr(fn.func, "__self__"):
            return fn.args[0]
        fn = fn.func
    return getattr(fn, "__self__", None)


@contextmanager
def checkpoints_fed(model: nn.Module | None, first: nn.Module, last: nn.Module, x: torch.Tensor, quiet: list):
    """The model's own checkpoint functions (`_gradient_checkpointing_func`, Hugging Face's) handed x, not the
    placeholder, when they run the first layer, and stopping the forward with the checkpoint's own output when they
    run the last. Where a model checkpoints a layer's `__call__` (transformers before 5.2x, and 4.x's loop), the hooks
    run inside the checkpoint: the backward's recompute, after the hooks are removed, would recompute the layer on the
    placeholder (other gradients, another count of saved tensors); and a reentrant checkpoint (4.x's default) computes
    its inside without grad, so the output the stop hook sees inside it carries no graph. `quiet` holds the stop hook
    while the last layer runs in its checkpoint."""
    held = [(m, vars(m)["_gradient_checkpointing_func"]) for m in (model.modules() if model is not None else ())
            if callable(vars(m).get("_gradient_checkpointing_func"))]
    for m, own in held:

        def fed(fn, *args, _own=own, **kwargs):
            layer = _bound_to(fn)
            if args and layer is first:
                h = args[0]
                args = tuple(x if a is h else a for a in args)
            if layer is not last:
                return _own(fn, *args, **kwargs)
            quiet.append(True)
            try:
                out = _own(fn, *args, **kwargs)
            finally:
                quiet.pop()
            raise Done(first_output(out))

        m._gradient_checkpointing_func = fed
    try:
        yield
    finally:
        for m, own in held:
            m._gradient_checkpointing_func = own


def drive(call: Callable[[], object], first: nn.Module, last: nn.Module, x: torch.Tensor,
          entered: Callable[[tuple, dict], None] | None = None, before: nn.Module | None = None,
          model: nn.Module | None = None):
    """`call()` (the model's forward on placeholders) with x in place of the hidden states `first` is given, stopped
    with `last`'s output, which is returned. `entered(args, kwargs)` sees what the model hands the first layer.
    `model`: the model whose checkpoint functions are handed x too (checkpoints_fed).

    `before`: the model's first layer when the span starts later (--layer N). The layers before the span run on the
    placeholders, as the model's plumbing; from `before` until `first` is entered, torch functions are hidden from
    torch-function modes, so tblock's tracers (FLOPs, roles, attention calls) see only the span's own work."""
    hidden, reached = [], []

    def hide(_m, _args):
        reached.append(True)  # the model's first layer entered: an error from here on is a layer's, not the model's
        if not hidden:
            hidden.append(torch._C.DisableTorchFunction())
            hidden[0].__enter__()

    def show() -> None:
        if hidden:
            hidden.pop().__exit__(None, None, None)

    def swap_in(_m, args, kwargs):
        reached.append(True)
        show()
        if entered is not None:
            entered(args, kwargs)
        h = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        # every argument that is the hidden states (funnel passes them as query, key and value)
        return tuple(x if a is h else a for a in args), {k: x if v is h else v for k, v in kwargs.items()}

    quiet: list = []  # the last layer running inside the model's own checkpoint: checkpoints_fed stops the forward

    def stop(_m, _args, out):
        if not quiet:
            raise Done(first_output(out))

    hooks = [first.register_forward_pre_hook(swap_in, with_kwargs=True), last.register_forward_hook(stop)]
    if before is not None and before is not first:
        hooks.append(before.register_forward_pre_hook(hide))
    try:
        with checkpoints_fed(model, first, last, x, quiet):
            call()
    except Done as done:
        return done.out
    except Exception as e:
        if not reached and not is_out_of_memory(e):
            try:
                e._tblock_before_layer = True  # the error as raised, marked (its type is what callers catch)
            except AttributeError:  # an exception type with __slots__
                pass
        raise
    finally:
        show()
        for h in hooks:
            h.remove()
    raise RuntimeError(f"the model's forward never reached {type(last).__name__}")


def is_causal(module: nn.Module, d_model: int) -> bool:
    """What the model does: whether earlier outputs ignore a change at a later position (eval, float32), both relative
    to the outputs and to what the layers add to their input there (probes.update_share)."""
    g = torch.Generator().manual_seed(0)
    p = next(module.layers.parameters())
    x = torch.randn(1, PROBE_T, d_model, generator=g).to(device=p.device, dtype=p.dtype)
    x2 = x.clone()
    x2[:, -1] = torch.randn(d_model, generator=g).to(x2)
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            a, b = module(x.clone())[:, :-1], module(x2)[:, :-1]
    finally:
        module.train(was)
    if not ((a - b).abs().max() <= CAUSAL_TOL * a.abs().max().clamp_min(1)).item():
        return False
    # behind a small branch gain (LayerScale 1e-5) a leak is as small as the update itself: judged against it too
    return update_share(b, a, x[:, :-1]) <= UPDATE_SHARE


def positional(module: nn.Module, base: nn.Module, d_model: int) -> bool:
    """Positions inside the layers: a rotary module, or position information the model hands them."""
    if any("rotary" in type(m).__name__.lower() for m in base.modules()):
        return True
    seen = {}
    layer = module.layers[0]

    def bound(_m, args, kwargs):  # positional arguments by name too (mpnet passes position_bias positionally)
        try:
            seen.update(inspect.signature(layer.forward).bind_partial(*args, **kwargs).arguments)
        except TypeError:
            seen.update(kwargs)

    hook = layer.register_forward_pre_hook(bound, with_kwargs=True)
    try:
        with torch.no_grad():
            module(torch.zeros(1, 2, d_model, dtype=next(module.layers.parameters()).dtype))
    finally:
        hook.remove()
    return any(seen.get(k) is not None for k in POSITION_KEYS) or any(
        "relative" in type(m).__name__.lower() or "rel_attn" in n for n, m in module.layers.named_modules())
