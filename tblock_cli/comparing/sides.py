"""The two sides of a comparison built at the shared size flags: a SPEC (`file.py:NAME`, `pkg.mod:NAME`, `hf:TYPE`),
`builtin`, or a module; causal when either is; the built-in block following the other side's declared layout."""

from __future__ import annotations

import dataclasses

import torch.nn as nn
import torch.nn.functional as F

from tblock_cli.errors import ConfigError
from tblock_cli.probes import module_copy

BUILTIN = "builtin"
# Flags that shape only the built-in block: given to a user side they would only earn it a warning.
BUILTIN_ONLY = ("norm", "activation", "eps", "bias")


def is_builtin(side) -> bool:
    return side is None or (isinstance(side, str) and side == BUILTIN)


def spec_of(side) -> object:
    """What api.setup takes for one side: None for the built-in block."""
    if side is None or (isinstance(side, str) and side == BUILTIN):
        return None
    if isinstance(side, nn.Module):
        return module_copy(side)  # A's weights are written into B: never into the caller's module
    if isinstance(side, str) and not side.strip():
        raise ConfigError("compare: a side is empty; give a SPEC (file.py:NAME, pkg.mod:NAME, hf:TYPE) or builtin")
    return side


def on_side(label: str, build, own_dtype: bool = False):
    """build(), with a user's mistake on one side named as that side's (both may be the same SPEC); the flags a side
    takes under compare are its own (--kwargs-a, --dtype-b), so setup's `--block`, `--kwargs` and `--dtype` are renamed."""
    from tblock_cli.errors import TBlockError

    try:
        return build()
    except TBlockError as e:
        text = str(e).removeprefix("--block ")
        suffix = label.lower()
        for flag in ("--kwargs", "--dtype"):
            if flag == "--kwargs" or own_dtype:
                text = text.replace(f"{flag} ", f"{flag}-{suffix} ")
        raise type(e)(f"side {label}: {text}") from None


def declared_layout(module: nn.Module) -> dict:
    """What a block says about itself that the built-in block can follow: nn.TransformerEncoderLayer's
    norm_first and activation, and its norms' eps."""
    out = {}
    norm_first = getattr(module, "norm_first", None)
    if isinstance(norm_first, bool):
        out["norm"] = "pre" if norm_first else "post"
    act = getattr(module, "activation", None)
    name = act if isinstance(act, str) else {F.relu: "relu", F.gelu: "gelu"}.get(act) if callable(act) and not isinstance(act, nn.Module) \
        else {nn.ReLU: "relu", nn.GELU: "gelu"}.get(type(act))
    if name in ("relu", "gelu"):
        out["activation"] = name
    eps = getattr(getattr(module, "norm1", None), "eps", None)
    if isinstance(eps, float):
        out["eps"] = eps
    return out


def build_sides(a, b, setup, options: dict, kwargs_a, kwargs_b, dtype_b: str | None, estimate):
    """(setup_a, subject_a, setup_b, subject_b, followed): each side built once, after its memory gate (`estimate`);
    `followed` is what the built-in side took from the other side's declared layout.

    An hf: side says whether it is causal only once built, and the built-in side follows the other's layout: so the
    hf: sides are built first, then the other user sides (causal when either is), then the built-in one."""
    spec_a, spec_b = spec_of(a), spec_of(b)
    given = {k: v for k, v in options.items() if v is not None}

    def opts(spec, kwargs, **extra):
        o = dict(given) if spec is None else {k: v for k, v in given.items() if k not in BUILTIN_ONLY}
        if spec is None:  # --layer: a model's, on each side that names one
            o.pop("layer", None)
        if spec is None and kwargs is not None:
            which = "--kwargs-a" if kwargs is kwargs_a else "--kwargs-b"
            raise ConfigError(f"{which} applies to a SPEC side, not to builtin (use the size flags)")
        return {**o, **extra, **({"kwargs": kwargs} if kwargs is not None else {})}

    dtype = {"a": {}, "b": {"dtype": dtype_b} if dtype_b else {}}
    specs, kwargs = {"a": spec_a, "b": spec_b}, {"a": kwargs_a, "b": kwargs_b}

    def side(k: str, build):  # a mistake on one side is named as that side's, under its own flags
        return on_side(k.upper(), build, k == "b" and dtype_b is not None)

    sides = {k: side(k, lambda k=k: setup(specs[k], opts(specs[k], kwargs[k], **dtype[k]))) for k in "ab"}
    subjects = {k: side(k, lambda k=k: sides[k].build(estimate, "compare")) for k in "ab" if sides[k].hf or sides[k].driven}
    if "causal" not in given and sides["a"].cfg.causal != sides["b"].cfg.causal:  # causal when either is
        k = "a" if not sides["a"].cfg.causal else "b"
        if sides[k].hf or sides[k].driven:  # what the model does stands; the flag only says how to probe it (built once, kept)
            sides[k].cfg = dataclasses.replace(sides[k].cfg, causal=True)
            subjects[k] = dataclasses.replace(subjects[k], causal=True)
        else:
            sides[k] = side(k, lambda k=k: setup(specs[k], opts(specs[k], kwargs[k], causal=True, **dtype[k])))
    for k in "ab":
        if specs[k] is not None and k not in subjects:
            subjects[k] = side(k, lambda k=k: sides[k].build(estimate, "compare"))
    followed = {}
    if (spec_a is None) != (spec_b is None):
        k, other = ("a", "b") if spec_a is None else ("b", "a")
        followed = {n: v for n, v in declared_layout(subjects[other].module).items() if n not in given}
        if followed:
            extra = {**followed, **dtype[k]}
            if sides[k].cfg.causal:
                extra["causal"] = True
            sides[k] = setup(None, opts(None, None, **extra))
    for k in "ab":
        if k not in subjects:
            subjects[k] = sides[k].build(estimate, "compare")
    return sides["a"], subjects["a"], sides["b"], subjects["b"], followed
