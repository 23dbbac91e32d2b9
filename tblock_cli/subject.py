"""Before measuring: the options checked into a config, the module looked into, and a way to build the subject."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import runtime
from tblock_cli.config import BUILTIN_ONLY, FLAGS, BlockConfig, Flag, build_config, check_type, parse_kwargs
from tblock_cli.errors import ConfigError, LoadError
from tblock_cli.loading import ALIASES, Subject, builtin_subject, construct, rebuilder, user_subject
from tblock_cli.report import RunInfo

# Flags that describe a user block's forward; the built-in block takes pad_mask, True = pad.
USER_ONLY = ("pad_keyword", "pad_means")


@dataclass
class Setup:
    """Everything a command needs before it measures: the validated config, where it runs, the block."""

    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    make: Callable[[], Subject]  # builds (or wraps) the block; called after the memory gate
    block: str  # "built-in", a SPEC, or the module's class name
    kwargs: dict
    warnings: tuple[str, ...]
    module: nn.Module | None = None  # the caller's own module, never changed: tblock works on a copy

    def run(self, subject: Subject | None = None, **config) -> RunInfo:
        cfg = {**self.cfg.as_dict(), "block": self.block, "kwargs": self.kwargs, **config}
        name = subject.name if subject is not None else self.block
        return RunInfo(name, cfg, runtime.environment(self.device, self.dtype), self.warnings)

    def session(self):
        """Threads as asked, and the caller's module (if any) as it was, after."""
        return runtime.session(self.cfg.threads, self.module)


def _infer(module: nn.Module, names: tuple[str, ...]) -> int | None:
    """A width or head count read from the module or its config under one of the usual names."""
    for m in [module, getattr(module, "config", None), *module.modules()]:
        for n in names:
            v = getattr(m, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def infer_d_model(module: nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(m, nn.MultiheadAttention):
            return m.embed_dim
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            return m.normalized_shape[0]
    found = _infer(module, ALIASES["d_model"])
    if found:
        return found
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None


def infer_n_heads(module: nn.Module, d_model: int) -> int:
    mha = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)), None)
    if mha is not None:
        return mha.num_heads
    found = _infer(module, ALIASES["n_heads"])
    return found if found and d_model % found == 0 else math.gcd(d_model, 8)


def private_copy(module: nn.Module, name: str) -> nn.Module:
    """A copy of the caller's module to move, train and time: their weights, buffers, gradients and modes stay put."""
    try:
        return copy.deepcopy(module)
    except Exception as e:  # noqa: BLE001 - a module that cannot be copied cannot be measured without changing it
        from tblock_cli.errors import one_line

        raise LoadError(f"{name}: tblock measures a copy so your module stays as it is, and copying it failed: "
                        f"{one_line(e)}; pass a factory (a function that builds it) instead") from None


def check_options(values: dict, **types: type) -> None:
    """An API caller's own keyword values (strict=, tree_depth=, ...) of the wrong type, as a ConfigError naming them."""
    for name, kind in types.items():
        value = values.get(name)
        if value is None:
            continue
        if kind is Callable:
            if not callable(value):
                raise ConfigError(f"{name} must be a function, got {value!r}")
        elif kind is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"{name} must be a dict (a saved run, as api.load_saved returns), got {type(value).__name__}")
        else:
            check_type(name, value, kind)


def setup(block=None, options: dict | None = None, *, same_shape: bool = True, allow_mixed: bool = False,
          layers_apply: bool = False, trains: bool = True) -> Setup:
    """Options (the CLI flags' names) -> validated config, device, dtype and a way to build the block.

    `trains`: the command runs the block in train mode (gradients, BatchNorm statistics), so a caller's
    module is copied even when it already sits on the device and dtype.
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    preset = options.pop("preset", None)
    kwargs = options.pop("kwargs", None)
    unknown = sorted(set(options) - set(FLAGS))
    if unknown:
        raise ConfigError(f"unknown option(s): {', '.join(unknown)}; known: {', '.join(FLAGS)}, preset, kwargs")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"--preset must be a string, got {preset!r}")
    if kwargs is not None and not isinstance(kwargs, (str, dict)):
        raise ConfigError("kwargs must be a dict or a JSON object string")
    extra = parse_kwargs(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
    warnings = []
    builtin = block is None
    hf_spec = isinstance(block, str) and block.startswith("hf:")
    if builtin and kwargs is not None:
        raise LoadError("--kwargs only applies with --block SPEC")
    ignored = [k for k in USER_ONLY if k in options] if builtin else \
        [k for k in BUILTIN_ONLY if k in options and not (k == "layers" and (layers_apply or hf_spec))]
    if ignored:
        names = ", ".join(Flag.option(k) for k in ignored)
        warnings.append(f"{names} describe(s) a user block's forward; the built-in block takes pad_mask (True = pad)"
                        if builtin else f"{names} shape(s) only the built-in block; the user block is built from its "
                        f"own code (pass its arguments with --kwargs)")
    if not builtin:
        for canonical in ("d_model", "n_heads", "d_ff"):  # --kwargs '{"dim": 64}' sizes the probe input too
            alias = next((a for a in ALIASES[canonical] if a in extra), None)
            if canonical not in options and alias is not None and isinstance(extra[alias], int):
                options[canonical] = extra[alias]
    module = None
    if isinstance(block, nn.Module):
        module, name = block, type(block).__name__
    elif block is not None and not isinstance(block, str):
        if not callable(block):
            raise ConfigError(f"block must be an nn.Module, a factory, a SPEC string or None, got {type(block).__name__}")
        name = getattr(block, "__name__", type(block).__name__)
    else:
        name = block or "built-in"
    if module is not None:
        if "d_model" not in options:
            d = infer_d_model(module)
            if d is None:
                raise ConfigError(f"cannot tell d_model from {name}: pass d_model=")
            options["d_model"] = d
        options.setdefault("n_heads", infer_n_heads(module, options["d_model"]))
    cfg = build_config(preset, allow_mixed=allow_mixed, builtin=builtin, **options)
    device = runtime.resolve_device(cfg.device)
    dtype = runtime.resolve_dtype(cfg.dtype, device)
    caller = module
    if hf_spec:
        module, name, cfg = hf_block(block, cfg, options, extra)
        caller = None
    warnings.extend(cfg.warnings)

    def make() -> Subject:
        if block is None:
            return builtin_subject(cfg, device, dtype)
        if module is not None:
            moves = not runtime.placed(module, device, dtype)
            own = private_copy(module, name) if caller is not None and (trains or moves) else module
            subject = user_subject(own, name, cfg, device, dtype, same_shape=same_shape)
            if hf_spec:
                from tblock_cli import hf

                subject.rebuild = hf.rebuilder(block[3:], cfg, extra, subject.module, dtype)
            return subject
        if isinstance(block, str):
            from tblock_cli.loading import make_subject

            return make_subject(cfg, device, dtype, block, extra, same_shape=same_shape)
        subject = user_subject(construct(name, block, cfg, extra), name, cfg, device, dtype, same_shape=same_shape)
        subject.rebuild = rebuilder(name, block, cfg, extra, dtype)
        return subject

    return Setup(cfg, device, dtype, make, name if not isinstance(block, str) else block, extra, tuple(warnings), caller)


def hf_block(spec: str, cfg: BlockConfig, options: dict, extra: dict) -> tuple[nn.Module, str, BlockConfig]:
    """An hf:TYPE block, and the config its model implies: causal for decoders, positions for rotary layers,
    HF's mask convention (attention_mask, 1 = keep). A flag the user gave explicitly stands."""
    from tblock_cli import hf

    module = hf.build(spec[3:], cfg, extra)
    implied = {"causal": module.causal, "positional": module.positional, "pad_keyword": module.pad_keyword, "pad_means": "keep"}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in implied.items() if k not in options},
                              warnings=cfg.warnings + module.warnings)
    return module, spec, cfg


def layer_maker(s: Setup, block) -> Callable[[int], list[Subject]] | None:
    """n independent layers of a user block: built anew per layer (seed + i), or copies re-initialised."""
    if block is None:
        return None
    if isinstance(block, str) and block.startswith("hf:"):
        from tblock_cli import hf

        def hf_layers(n: int) -> list[Subject]:
            first = s.make()  # the calling convention (mask keyword, causal) around the model setup built
            layers = first.module.single_layers()
            if len(layers) != n:  # only when asked for another depth than --layers: a model of n layers
                layers = hf.build(block[3:], dataclasses.replace(s.cfg, layers=n), s.kwargs).single_layers()
            return [first.like(layer) for layer in layers]
        return hf_layers
    if isinstance(block, str):
        from tblock_cli.loading import user_layers

        return lambda n: user_layers(s.cfg, s.device, s.dtype, block, s.kwargs, n)

    def copies(n: int) -> list[Subject]:
        first = s.make()  # the caller's module is copied here, so re-initialising touches only tblock's copies
        layers = [first]
        for i in range(1, n):
            module = copy.deepcopy(first.module)
            torch.manual_seed(s.cfg.seed + i)
            for m in module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            layers.append(first.like(module))
        return layers
    return copies
