"""The two sides of a comparison built at the shared size flags: a SPEC (`file.py:NAME`, `pkg.mod:NAME`, `hf:TYPE`),
`builtin`, or a module; causal when either is; the built-in block following the other side's declared layout."""

from __future__ import annotations

import copy

import torch.nn as nn
import torch.nn.functional as F

from tblock_cli.errors import ConfigError

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
        return copy.deepcopy(side)  # A's weights are written into B: never into the caller's module
    if isinstance(side, str) and not side.strip():
        raise ConfigError("compare: a side is empty; give a SPEC (file.py:NAME, pkg.mod:NAME, hf:TYPE) or builtin")
    return side


def check_side_options(kwargs_a, kwargs_b, dtype_b) -> None:
    """--kwargs-a, --kwargs-b and --dtype-b judged under their own names (setup would name --kwargs and --dtype)."""
    import json

    from tblock_cli.config import DTYPES

    for flag, text in (("--kwargs-a", kwargs_a), ("--kwargs-b", kwargs_b)):
        if text is None or isinstance(text, dict):
            continue
        if not isinstance(text, str):
            raise ConfigError(f"{flag} must be a JSON object string (or a dict), got {type(text).__name__}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} is not valid JSON: {e.msg} (at character {e.pos})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"norm_first\": true}}'")
    if dtype_b is not None and dtype_b not in DTYPES:
        raise ConfigError(f"--dtype-b must be one of {', '.join(DTYPES)}, got {dtype_b!r}")


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


def build_sides(a, b, setup, options: dict, kwargs_a, kwargs_b, dtype_b: str | None):
    """(setup_a, subject_a, setup_b, subject_b, followed): both built; `followed` is what the built-in side took
    from the other side's declared layout."""
    spec_a, spec_b = spec_of(a), spec_of(b)
    given = {k: v for k, v in options.items() if v is not None}

    def opts(spec, kwargs, **extra):
        o = dict(given) if spec is None else {k: v for k, v in given.items() if k not in BUILTIN_ONLY}
        if spec is None and kwargs is not None:
            which = "--kwargs-a" if kwargs is kwargs_a else "--kwargs-b"
            raise ConfigError(f"{which} applies to a SPEC side, not to builtin (use the size flags)")
        return {**o, **extra, **({"kwargs": kwargs} if kwargs is not None else {})}

    sa = on_side("A", lambda: setup(spec_a, opts(spec_a, kwargs_a)))
    sb = on_side("B", lambda: setup(spec_b, opts(spec_b, kwargs_b, **({"dtype": dtype_b} if dtype_b is not None else {}))),
                 dtype_b is not None)
    if "causal" not in given and sa.cfg.causal != sb.cfg.causal:  # causal when either is
        if not sa.cfg.causal:
            sa = on_side("A", lambda: setup(spec_a, opts(spec_a, kwargs_a, causal=True)))
        else:
            sb = on_side("B", lambda: setup(spec_b, opts(spec_b, kwargs_b, causal=True,
                                                         **({"dtype": dtype_b} if dtype_b is not None else {}))),
                         dtype_b is not None)
    subject_a, subject_b = on_side("A", sa.make), on_side("B", sb.make, dtype_b is not None)
    followed = {}
    if (spec_a is None) != (spec_b is None):
        other = subject_b if spec_a is None else subject_a
        followed = {k: v for k, v in declared_layout(other.module).items() if k not in given}
        if followed:
            extra = {**followed, **({"dtype": dtype_b} if dtype_b is not None and spec_b is None else {})}
            if sa.cfg.causal and spec_a is None or sb.cfg.causal and spec_b is None:
                extra["causal"] = True
            if spec_a is None:
                sa = setup(None, opts(None, None, **extra))
                subject_a = sa.make()
            else:
                sb = setup(None, opts(None, None, **extra))
                subject_b = sb.make()
    return sa, subject_a, sb, subject_b, followed
