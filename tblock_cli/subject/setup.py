"""Before measuring: the options turned into a config, the module looked into, and the one pipeline that builds it."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import runtime
from tblock_cli.config import BUILTIN_ONLY, BlockConfig, Flag, build_config, parse_kwargs
from tblock_cli.errors import ConfigError, LoadError
from tblock_cli.report import RunInfo
from tblock_cli.subject import Subject
from tblock_cli.subject.loading import ALIASES, builtin_subject, construct, materialised, user_subject

# Flags that describe a user block's forward; the built-in block takes pad_mask, True = pad.
USER_ONLY = ("pad_keyword", "pad_means")

# A command's memory need in bytes from the config and the block's parameter count (None: the built-in block's).
Estimate = Callable[[BlockConfig, "int | None"], int]


@dataclass
class Setup:
    """Everything a command needs before it measures: the validated config, where it runs, and the one way to build
    the block (`build`). An hf: block's config gains what its model implies (causal, positions, mask) once built."""

    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    source: object  # what the caller handed in: None (built-in), a SPEC, a module or a factory
    block: str  # "built-in", a SPEC, or the module's class name
    kwargs: dict
    warnings: tuple[str, ...]
    module: nn.Module | None = None  # the caller's own module, never changed: tblock works on a copy
    same_shape: bool = True
    trains: bool = True
    given: tuple[str, ...] = ()  # the flags the caller gave: an hf: model's implied value never overrides one
    built: nn.Module | None = None  # an hf: model's layers, built once however often they are asked for
    _factory: object = None  # the class or function a SPEC's block was built from (its file run once for it)

    def run_info(self, subject: Subject | None = None, **config) -> RunInfo:
        cfg = {**self.cfg.as_dict(), "block": self.block, "kwargs": self.kwargs, **config}
        name = subject.name if subject is not None else self.block
        return RunInfo(name, cfg, runtime.environment(self.device, self.dtype), self.warnings)

    def session(self):
        """Threads as asked, and the caller's module (if any) as it was, after."""
        return runtime.session(self.cfg.threads, self.module)

    @property
    def hf(self) -> bool:
        return isinstance(self.source, str) and self.source.startswith("hf:")

    def factory(self):
        """The class or function the block (or, with --layer, its model) is built from."""
        if isinstance(self.source, str):
            from tblock_cli.subject.loading import load_factory

            return load_factory(self.source)
        return self.source

    def note_dropped(self, notes: list[tuple[str, str]]) -> tuple[str, ...]:
        """Warnings, not said yet, for the flags the user gave that the block's config could not take; now said."""
        dropped = tuple(text for flag, text in notes if flag in self.given and text not in self.warnings)
        self.warnings = self.warnings + dropped
        return dropped

    @property
    def driven(self) -> bool:
        """A layer of a model over token ids, driven by the model's forward (--layer N)."""
        return self.cfg.layer is not None and not self.hf

    def gate(self, estimate: Estimate, what: str, params: int | None = None, allocated: int = 0) -> None:
        """Refuse, before allocating, work estimated larger than the free memory (less what is allocated already)."""
        runtime.ensure_fits(estimate(self.cfg, params) - allocated, self.device, what)

    def build(self, estimate: Estimate | None = None, what: str = "") -> Subject:
        """The one build pipeline, inside `session()`: gate on the command's estimate (the built-in block's count) ->
        build (an hf: model too, once) -> gate on the block's real parameter count, less the weights now allocated ->
        a private copy of a caller's module -> wrapped as a Subject."""
        if estimate is not None:
            self.gate(estimate, what)
        builtin = builtin_subject(self.cfg, self.device, self.dtype) if self.source is None else None
        module = builtin.module if builtin is not None else self._module()
        materialised(module, self.cfg, self.device, self.dtype)
        if estimate is not None:
            n = sum(p.numel() for p in module.parameters())
            # weights built here are allocated already; a caller's module is still to be copied
            self.gate(estimate, what, n, 0 if self.module is not None else n * self.dtype.itemsize)
        return builtin if builtin is not None else self._wrap(module)

    def resolve(self) -> None:
        """Build an hf: model now, unwrapped, so the config it implies (causal, positions, mask) is known before a command
        reads `cfg` (depth builds its layers later); nothing for other blocks."""
        if self.hf or self.driven:
            self._module()

    def make(self) -> Subject:
        """The block built with no gate, for a command that gated already (depth's layers of a stack)."""
        return builtin_subject(self.cfg, self.device, self.dtype) if self.source is None else self._wrap(self._module())

    def _module(self) -> nn.Module:
        """The user's module as constructed, before it is moved, copied or probed."""
        if self.hf or self.driven:
            if self.built is None:
                self.built = hf_block(self) if self.hf else driven_block(self)
            return self.built
        if self.module is not None:
            return self.module
        notes: list[tuple[str, str]] = []
        self._factory = self.factory()
        module = construct(self.block, self._factory, self.cfg, self.kwargs, notes)
        self.note_dropped(notes)
        return module

    def _wrap(self, module: nn.Module) -> Subject:
        if self.module is not None:
            moves = not runtime.placed(module, self.device, self.dtype)
            module = private_copy(module, self.block) if self.trains or moves else module
        subject = user_subject(module, self.block, self.cfg, self.device, self.dtype, same_shape=self.same_shape)
        if self.hf or self.driven:  # the family's known departures, as tblock's hf: builder found them
            subject.by_design = dict(module.by_design)
        subject.rebuild = self._rebuilder(subject.module)
        if self._factory is not None:  # a SPEC's own block (_module sets it for no other)
            # a second instance from the very class or function the block came from, on the meta device: what it
            # shares with the block (a default argument, a module-level cache) is what a program's layers share
            subject.sibling = self._sibling
        if self.cfg.layer is not None:  # which layer of the model, in every report's title
            first, last = subject.module.span
            subject.name = f"{self.block} layer {first}" if first == last else f"{self.block} layers {first}-{last}"
        return subject

    def _sibling(self) -> nn.Module:
        with torch.device("meta"):
            return construct(self.block, self._factory, self.cfg, self.kwargs, [])

    def _rebuilder(self, built: nn.Module):
        """Subject.rebuild: the block built anew from what it was built from; None for a caller's module instance."""
        if self.module is not None:
            return None
        if self.hf:
            from tblock_cli.subject import hf

            return hf.rebuilder(self.source[3:], self.cfg, self.kwargs, built, self.dtype)
        if self.driven:
            from tblock_cli.subject import driven

            return driven.rebuilder(self.block, self.factory(), self.cfg, self.kwargs, self.cfg.layer, built, self.dtype)
        from tblock_cli.subject.loading import rebuilder

        return rebuilder(self.block, self.factory(), self.cfg, self.kwargs, self.dtype)


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


def refuse_scripted(module: nn.Module, name: str) -> None:
    """A TorchScript module (torch.jit.script or trace) shares its parameters with every copy and hides its forward
    from hooks and the tracer: gradients would land on the caller's module and half the checks could not run."""
    if isinstance(module, torch.jit.ScriptModule):
        raise LoadError(f"{name} is a TorchScript module (torch.jit.script or trace), which tblock does not support: "
                        f"its copies share the caller's parameters and its forward cannot be traced; pass the module "
                        f"before scripting (or a factory that builds it)")


def setup(block=None, options: dict | None = None, *, same_shape: bool = True, allow_mixed: bool = False,
          layers_apply: bool = False, trains: bool = True) -> Setup:
    """Options (the CLI flags' names) -> validated config, device, dtype and a way to build the block.

    `trains`: the command runs the block in train mode (gradients, BatchNorm statistics), so a caller's
    module is copied even when it already sits on the device and dtype.
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}  # judged by options.shared already
    preset = options.pop("preset", None)
    kwargs = options.pop("kwargs", None)
    extra = parse_kwargs(kwargs) if isinstance(kwargs, str) else dict(kwargs or {})
    warnings = []
    builtin = block is None
    hf_spec = isinstance(block, str) and block.startswith("hf:")
    if options.get("layer") is not None and (builtin or isinstance(block, nn.Module)):
        raise ConfigError("--layer N drives a layer of the model --block builds (hf:TYPE, path/to/file.py:NAME or "
                          "package.module:NAME, a class or builder over token ids)")
    driven_spec = options.get("layer") is not None
    ignored = [k for k in USER_ONLY if k in options] if builtin else \
        [k for k in BUILTIN_ONLY if k in options and not (k == "layers" and (layers_apply or hf_spec or driven_spec))]
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
    module = block if isinstance(block, nn.Module) else None
    if module is not None:
        name = type(block).__name__
        refuse_scripted(module, name)
    elif block is not None and not isinstance(block, str):
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
    warnings.extend(cfg.warnings)
    return Setup(cfg, device, dtype, block, name, extra, tuple(warnings), module, same_shape, trains, tuple(options))


def hf_block(s: Setup) -> nn.Module:
    """An hf:TYPE block, and the config its model implies written into the setup: causal for decoders, positions for
    rotary layers, HF's mask convention (attention_mask, 1 = keep). A flag the user gave explicitly stands."""
    from tblock_cli.subject import hf

    module = hf.build(s.source[3:], s.cfg, s.kwargs)
    implied = {"causal": module.causal, "positional": module.positional, "pad_keyword": module.pad_keyword, "pad_means": "keep"}
    s.cfg = dataclasses.replace(s.cfg, **{k: v for k, v in implied.items() if k not in s.given},
                                warnings=s.cfg.warnings + module.warnings)
    s.warnings = s.warnings + tuple(module.warnings)
    return module


def driven_block(s: Setup) -> nn.Module:
    """Layer --layer of the model --block builds, and what the model does written into the setup (causal, positions);
    a flag the user gave explicitly stands. Flags its config could not take are warned, as for any config."""
    from tblock_cli.subject import driven

    notes: list[tuple[str, str]] = []
    module = driven.build(s.block, s.factory(), s.cfg, s.kwargs, s.cfg.layer, notes)
    dropped = s.note_dropped([(flag, text) for flag, text in notes if not driven.reaches(module, flag, s.cfg)])
    implied = {"causal": module.causal, "positional": module.positional}
    s.cfg = dataclasses.replace(s.cfg, **{k: v for k, v in implied.items() if k not in s.given},
                                warnings=s.cfg.warnings + dropped)
    return module


def layer_maker(s: Setup, block) -> Callable[[int], list[Subject]] | None:
    """n independent layers of a user block: built anew per layer (seed + i), or copies re-initialised."""
    if block is None:
        return None
    if s.hf or s.driven:  # a model's layers, each driven through the model built once
        def model_layers(n: int) -> list[Subject]:
            first = s.make()  # the calling convention (mask keyword, causal) around the model built once
            layers = first.module.single_layers()
            if len(layers) != n:  # only when asked for another depth than --layers: a model of n more layers
                layers = dataclasses.replace(s, cfg=dataclasses.replace(s.cfg, layers=n), built=None)._module().single_layers()
            return [first.like(layer) for layer in layers]
        return model_layers
    if isinstance(block, str):
        from tblock_cli.subject.loading import user_layers

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

