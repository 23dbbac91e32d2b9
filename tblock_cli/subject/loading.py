"""A block under test built: the built-in one from flags, or the user's own from a --block SPEC, probed once."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.config import TO_CONSTRUCTOR, BlockConfig, Flag, parse_kwargs
from tblock_cli.errors import USER_ERRORS, LoadError, is_out_of_memory, one_line
from tblock_cli.probes import cast, reseed, train_mode
from tblock_cli.runtime import dtype_name
from tblock_cli.subject import Subject, first_tensor  # noqa: F401 - Subject: where callers long found it
from tblock_cli.subject.builtin import build_block
from tblock_cli.subject.hf.families import family_rules
from tblock_cli.subject.portable import missing_dependency, on_this_machine

# Constructor keywords tblock fills from its flags (config.TO_CONSTRUCTOR), under the names blocks commonly use.
ALIASES: dict[str, tuple[str, ...]] = {
    "d_model": ("d_model", "embed_dim", "dim", "n_embd", "hidden_size", "model_dim", "emb_dim", "d_embed"),
    "n_heads": ("n_heads", "nhead", "num_heads", "n_head", "nheads", "heads", "num_attention_heads"),
    "d_ff": ("d_ff", "dim_feedforward", "ffn_dim", "ff_dim", "intermediate_size", "mlp_dim", "d_inner", "dim_ff",
             "intermediate_dim", "dff", "encoder_ffn_dim", "ffn_hidden_size"),
    "dropout": ("dropout", "dropout_p", "p_dropout", "dropout_rate", "attn_dropout"),
    "causal": ("causal", "is_causal"),
}
PAD_KEYWORDS = ("pad_mask", "key_padding_mask", "src_key_padding_mask", "padding_mask")


def builtin_subject(cfg: BlockConfig, device: torch.device, dtype: torch.dtype) -> Subject:
    module = build_block(cfg, device, dtype)
    kind = f"built-in {cfg.norm}-LN block" + (f" x{cfg.layers}" if cfg.layers > 1 else "")
    rebuild = lambda seed, where: build_block(replace(cfg, seed=seed), where, dtype)  # noqa: E731
    return Subject(module, kind, True, "pad_mask", cfg.causal, rebuild=rebuild)


def make_subject(
    cfg: BlockConfig,
    device: torch.device,
    dtype: torch.dtype,
    spec: str | None = None,
    kwargs_json: str | dict | None = None,
    *,
    same_shape: bool = True,
) -> Subject:
    """The built-in block, or the user's block loaded, built, moved and probed once.

    `same_shape=False` lets a block whose output shape differs through (check reports it as a
    failed `shape` check); params and bench need the shape kept and refuse it here.
    """
    if spec is None:
        if kwargs_json is not None:
            raise LoadError("--kwargs only applies with --block SPEC")
        return builtin_subject(cfg, device, dtype)
    factory = load_factory(spec)
    extra = kwargs_json if isinstance(kwargs_json, dict) else parse_kwargs(kwargs_json)
    subject = user_subject(construct(spec, factory, cfg, extra), spec, cfg, device, dtype, same_shape=same_shape)
    subject.rebuild = rebuilder(spec, factory, cfg, extra, dtype)
    return subject


def rebuilder(spec: str, factory: Callable, cfg: BlockConfig, extra: dict, dtype: torch.dtype) -> Callable[[int, str], nn.Module]:
    """The block built anew from its factory at another seed, on the CPU or the meta device (Subject.rebuild); with
    dropout, at that rate (the flag, and a dropout keyword among the user's --kwargs, set to it)."""
    def rebuild(seed: int, where: str, dropout: float | None = None) -> nn.Module:
        flags, kwargs = replace(cfg, seed=seed), extra
        if dropout is not None:
            flags = replace(flags, dropout=dropout)
            kwargs = {k: dropout if k in ALIASES["dropout"] else v for k, v in extra.items()}
        with torch.device(where):
            module = construct(spec, factory, flags, kwargs)
        module = cast(module, dtype)
        if where != "meta":
            materialised(module, flags, torch.device(where), dtype)
        return module
    return rebuild


def user_subject(module: nn.Module, name: str, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *,
                 same_shape: bool = True) -> Subject:
    """A user's module moved to the device and dtype, its padding keyword found, probed once."""
    if isinstance(module, torch.jit.ScriptModule):
        raise LoadError(f"--block {name}: it builds a TorchScript module (torch.jit.script or trace), which tblock does "
                        f"not support (its forward cannot be traced); build the module without scripting it")
    narrow = narrow_parameters(module)
    try:
        module = cast(module, dtype, device)
    except Exception as e:  # noqa: BLE001 - any failure here is the user's block
        if is_out_of_memory(e):
            raise
        raise LoadError(f"--block {name}: moving it to {device}/{dtype} failed: {one_line(e)}") from None
    subject = Subject(module, name, False, pad_keyword(module, cfg.pad_keyword, name), cfg.causal, cfg.pad_means,
                      family_rules(module))
    subject.trained_at_build = frozenset(n for n, p in module.named_parameters() if p.requires_grad)
    subject.narrow_at_build = narrow
    probe(subject, cfg, device, dtype, same_shape=same_shape)
    return subject


def narrow_parameters(module: nn.Module) -> tuple[str, dict[str, str]] | None:
    """Floating parameters built in a narrower dtype than most of the block's (a `dtype=torch.bfloat16` left in one
    constructor of a float32 block): (the block's dtype, name -> its dtype), or None. Wider ones are a design's (a
    router kept in float32 in a bfloat16 block); one-byte (float8) weights are a quantisation's; frozen ones are not
    trained."""
    from collections import Counter

    floats = [(n, p.dtype) for n, p in module.named_parameters()
              if p.is_floating_point() and p.dtype.itemsize > 1 and p.requires_grad]
    counts = Counter(d for _, d in floats)
    if len(counts) < 2:
        return None
    major = counts.most_common(1)[0][0]
    narrow = {n: dtype_name(d) for n, d in floats if d.itemsize < major.itemsize}
    return (dtype_name(major), narrow) if narrow else None


def user_layers(cfg: BlockConfig, device: torch.device, dtype: torch.dtype, spec: str, extra: dict, n: int) -> list[Subject]:
    """n independent instances of the user's block (seeds seed, seed+1, ...), for a stack of copies."""
    factory = load_factory(spec)
    first = user_subject(construct(spec, factory, cfg, extra), spec, cfg, device, dtype)  # probed once
    return [first] + [first.like(cast(construct(spec, factory, replace(cfg, seed=cfg.seed + i), extra), dtype, device))
                      for i in range(1, n)]


def load_factory(spec: str) -> Callable:
    """`package.module:NAME` or `path/to/file.py:NAME` -> the object NAME."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise LoadError(f"--block {spec!r}: expected package.module:NAME or path/to/file.py:NAME")
    try:  # a name the file system refuses (too long, a NUL byte) is the user's to fix, in one line
        is_path = target.endswith(".py") or "/" in target or "\\" in target or Path(target).is_file()
        path = Path(target).expanduser().resolve() if is_path else None
        kind = "folder" if is_path and path.is_dir() else "file" if is_path and path.is_file() else None
    except (OSError, ValueError) as e:
        raise LoadError(f"--block: cannot read the path {target[:80]}{'...' if len(target) > 80 else ''}: "
                        f"{getattr(e, 'strerror', None) or e}") from None
    if is_path:
        if kind == "folder":
            raise LoadError(f"--block {spec}: {target} is a folder; give path/to/file.py:NAME")
        if kind is None:
            raise LoadError(f"--block {spec}: file {target} not found")
        if path.suffix != ".py":
            raise LoadError(f"--block {spec}: {target} is not a .py file; give path/to/file.py:NAME or package.module:NAME")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # so the file can import its siblings
        mod_name = f"tblock_user_{path.stem}"
        try:
            ispec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(ispec)
            sys.modules[mod_name] = module
            ispec.loader.exec_module(module)
        except USER_ERRORS as e:  # a file that calls sys.exit() is a load error too
            raise LoadError(f"--block {spec}: " + (missing_dependency(e) or f"importing {target} failed: {one_line(e)}")) from None
    else:
        if not all(part.isidentifier() for part in target.split(".")):
            raise LoadError(f"--block {spec}: {target!r} is not a .py file and not an importable module name; "
                            f"give path/to/file.py:NAME or package.module:NAME")
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: `examples.my_block` from the repo root
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name is None or not target.startswith(e.name):  # the module imports something missing
                raise LoadError(f"--block {spec}: " + (missing_dependency(e) or
                                                       f"cannot import module {target!r}: {one_line(e)}")) from None
            raise LoadError(f"--block {spec}: cannot import module {target!r} ({one_line(e)}): {target} is not a .py "
                            f"file and not an importable module; give path/to/file.py:NAME or package.module:NAME") from None
        except USER_ERRORS as e:
            raise LoadError(f"--block {spec}: " + (missing_dependency(e) or
                                                   f"cannot import module {target!r}: {one_line(e)}")) from None
    if not hasattr(module, name):
        raise LoadError(f"--block {spec}: {target} has no attribute {name!r}")
    obj = getattr(module, name)
    if not callable(obj):
        raise LoadError(f"--block {spec}: {name} is not a class or a factory function")
    return obj


def constructor_kwargs(factory: Callable, cfg: BlockConfig) -> tuple[dict, bool]:
    """The flags the factory's signature accepts, under the first alias it names.

    The second value says whether the signature also takes **kwargs (a subclass passing its
    arguments on): then the canonical names are worth a try for the flags it does not name.
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}, False
    values = flag_values(cfg)
    kwargs = {}
    for canonical, names in ALIASES.items():
        if canonical not in values:
            continue
        named = next((n for n in names if n in params), None)
        if named is not None:
            kwargs[named] = values[canonical]
    if "batch_first" in params:
        kwargs["batch_first"] = True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return kwargs, var_kw


def flag_values(cfg: BlockConfig) -> dict:
    """The flags a user block's constructor may take, by canonical name. causal only with --causal:
    without it the block keeps its own default (a causal-by-default block stays causal)."""
    values = {k: getattr(cfg, k) for k in TO_CONSTRUCTOR} | {"d_ff": cfg.ffn_dim}
    if not cfg.causal:
        del values["causal"]
    return values


def construct(spec: str, factory: Callable, cfg: BlockConfig, extra: dict, notes: list | None = None) -> nn.Module:
    """The user's block built from the flags and --kwargs; `notes` gathers (flag, sentence) for each size
    flag the block's config could not take. Built where CUDA placements work (portable.on_this_machine); an optional
    dependency its constructor imports and this machine lacks is one line naming its install command."""
    try:
        with on_this_machine():
            return construct_here(spec, factory, cfg, extra, notes)
    except ImportError as e:
        missing = missing_dependency(e)
        if missing is None:
            raise LoadError(f"--block {spec}: calling it failed: {one_line(e)}") from None
        raise LoadError(f"--block {spec}: {missing}") from None


def construct_here(spec: str, factory: Callable, cfg: BlockConfig, extra: dict, notes: list | None) -> nn.Module:
    from tblock_cli.subject import configs

    param = configs.config_param(factory)
    if param is not None and param.name not in extra:
        return construct_with_config(spec, factory, param, cfg, extra, notes)
    named, var_kw = constructor_kwargs(factory, cfg)
    attempts = [{**named, **extra}]
    if var_kw:  # try the canonical names through **kwargs first, then without them
        aliased = {a for names in ALIASES.values() for a in names if a in named}
        unnamed = {k: v for k, v in flag_values(cfg).items() if not set(ALIASES[k]) & aliased}
        if unnamed:
            attempts.insert(0, {**unnamed, **named, **extra})
    if extra and attempts[-1] != extra:
        attempts.append(dict(extra))  # a constructor that rejects the injected flag names: the user's kwargs alone
    tried = []
    for kwargs in attempts:
        reseed(cfg.seed)
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        try:
            module = factory(**kwargs)
            _remember_arguments(module, factory, kwargs)
            break
        except USER_ERRORS as e:  # any rejection: try the next way, then report all
            if is_out_of_memory(e) or isinstance(e, ImportError):
                raise
            tried.append(f"({shown or 'no arguments'}): {one_line(e)}")
    else:
        raise LoadError(f"--block {spec}: calling it failed " + "; then ".join(tried)) from None
    if not isinstance(module, nn.Module):
        raise LoadError(f"--block {spec}: calling it with ({shown}) returned {type(module).__name__}, not a torch.nn.Module")
    return module


# The arguments each block tblock built was constructed with (defaults included): what it says of itself, which the
# spec check holds against its card (card/own.py). Weak: a block's entry goes with the block.
_ARGUMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remember_arguments(module, factory: Callable, kwargs: dict) -> None:
    if not isinstance(module, nn.Module):
        return
    try:
        bound = inspect.signature(factory).bind_partial(**kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, p in bound.signature.parameters.items():  # what came through **kwargs is an argument too
            if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(arguments.get(name), dict):
                arguments.update(arguments.pop(name))
    except (TypeError, ValueError):
        arguments = dict(kwargs)
    _ARGUMENTS[module] = arguments


def constructed_arguments(module: nn.Module) -> dict:
    """The arguments tblock built module with, defaults included; {} for a module handed over built."""
    return _ARGUMENTS.get(module, {})


def construct_with_config(spec: str, factory: Callable, param, cfg: BlockConfig, extra: dict, notes: list | None) -> nn.Module:
    """A block whose constructor takes a config object (nanoGPT's GPTConfig, gpt-fast's ModelArgs, minGPT's CfgNode):
    the object built from the flags under its own field names and --kwargs (keys the constructor itself names stay
    with the constructor), then the block from it."""
    from tblock_cli.subject import configs

    try:
        own = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        own = {}
    flags = flag_values(cfg)
    values, unreached = configs.config_values(param, flags, ALIASES, {k: v for k, v in extra.items() if k not in own})
    what = getattr(param.cls, "__name__", "config")
    try:
        obj = configs.build_config_object(param, values, set(extra))
    except USER_ERRORS as e:
        if is_out_of_memory(e):
            raise
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise LoadError(f"--block {spec}: building its {what} ({shown}) failed: {one_line(e)}; pass its fields with "
                        f"--kwargs") from None
    if notes is not None:
        for canonical in unreached:
            if canonical in ("d_model", "n_heads", "d_ff"):
                notes.append((canonical, f"{Flag.option(canonical)} does not reach {spec}: its {what} has no field for it"))
        for canonical, asked, got in configs.read_back(obj, ALIASES, flags):
            notes.append((canonical, f"{Flag.option(canonical)} {asked} does not reach {spec}: its {what} holds {got}"))
    reseed(cfg.seed)
    try:
        index = {k: 0 for k in configs.LAYER_INDEX  # a required layer index: the first layer of a stack
                 if k in own and own[k].default is inspect.Parameter.empty and k not in extra}
        module = factory(**{param.name: obj}, **index, **{k: v for k, v in extra.items() if k in own})
        _remember_arguments(module, factory, {param.name: obj, **{k: v for k, v in extra.items() if k in own}})
    except USER_ERRORS as e:
        if is_out_of_memory(e) or isinstance(e, ImportError):
            raise
        raise LoadError(f"--block {spec}: calling it with a {what} failed: {one_line(e)}") from None
    if not isinstance(module, nn.Module):
        raise LoadError(f"--block {spec}: calling it with a {what} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def pad_keyword(module: nn.Module, asked: str | None = None, name: str = "") -> str | None:
    """The forward keyword for the padding mask: the one asked for (--pad-keyword), else a known name."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        params = {}
    if asked is not None:
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        where = f"--pad-keyword {asked}: {name or type(module).__name__}.forward"
        if named and asked == named[0] and params[asked].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise LoadError(f"{where} takes its input as {asked}; name the mask's keyword (it takes {', '.join(params)})")
        if asked not in named and not (takes_any and asked not in params):
            raise LoadError(f"{where} takes no such keyword (it takes {', '.join(params) or 'nothing'})")
        return asked
    return next((k for k in PAD_KEYWORDS if k in params), None)


def probe(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *, same_shape: bool) -> None:
    """Call the block once on (B, T, d) input so a broken forward is a load error, not 14 errors."""
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, device=device, dtype=dtype)
    try:
        with train_mode(subject.module, False), torch.no_grad():
            out = subject.module(x)
    except USER_ERRORS as e:
        if is_out_of_memory(e):
            raise
        raise LoadError(f"--block {subject.name}: forward on x of shape {tuple(x.shape)} failed: {one_line(e)}") from None
    try:
        out = first_tensor(out)
    except TypeError as e:
        raise LoadError(f"--block {subject.name}: {e}") from None
    if same_shape and out.shape != x.shape:
        raise LoadError(
            f"--block {subject.name}: output shape {tuple(out.shape)} differs from the input's {tuple(x.shape)}; "
            f"tblock needs a block that maps (batch, seq, d_model) to the same shape"
        )


def materialised(module: nn.Module, cfg: BlockConfig, device: torch.device, dtype: torch.dtype) -> None:
    """A block with lazy modules (nn.LazyLinear) gets its parameters' shapes from one forward, as its own training
    script's dry run gives them: run here once (eval, no grad) on the standard input's shape, before anything counts
    them. A forward that raises is the user's block refusing that input: one line."""
    from torch.nn.parameter import is_lazy

    if not any(is_lazy(p) for p in module.parameters()):
        return
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, device=device, dtype=dtype)
    was = module.training
    try:
        with torch.no_grad():
            module.eval()(x)
    except Exception as e:  # noqa: BLE001 - the block's own forward
        raise LoadError(f"its lazy modules could not be materialised by one forward of shape {tuple(x.shape)}: "
                        f"{one_line(e)}") from None
    finally:
        module.train(was)
