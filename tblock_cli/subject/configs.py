"""Config objects a block's constructor takes (a dataclass, a class with from_name/from_dict, an attribute bag),
built from --kwargs and tblock's size flags under the config's own field names."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from typing import Callable

# The parameter names a constructor gives the config object it takes, when it does not annotate its type.
CONFIG_PARAMS = ("config", "cfg", "args", "model_args", "params", "conf", "hparams", "model_config")
# A config's query-head and key/value-head counts (gpt-fast, Meta's llama, litgpt, transformers).
HEADS = ("n_head", "n_heads", "num_attention_heads", "num_heads")
KV_HEADS = ("n_local_heads", "n_kv_heads", "n_query_groups", "num_key_value_heads", "num_kv_heads", "n_head_kv")
# A layer's index in its stack, a required argument beside the config in Meta's llama (`layer_id`) and transformers
# (`layer_idx`): the first layer's.
LAYER_INDEX = ("layer_id", "layer_idx", "layer_index", "layer_number")
# Required fields with no default that size only what a block never sees (the embedding, the stack, the longest
# sequence): small placeholders, large enough for tblock's probe sequences (--seq defaults to 16).
PLACEHOLDERS = {
    "vocab_size": 256, "n_vocab": 256, "padded_vocab_size": 256,
    "n_layer": 1, "n_layers": 1, "num_layers": 1, "num_hidden_layers": 1,
    "block_size": 1024, "max_seq_len": 1024, "max_position_embeddings": 1024, "max_len": 1024, "context_length": 1024,
}

# Config field names beyond the constructor keywords of loading.ALIASES (Meta's and gpt-fast's FFN width, GPT-2's
# n_inner, minGPT's dropouts).
MORE_ALIASES = {
    "d_ff": ("hidden_dim", "n_inner", "ffn_hidden_size", "mlp_hidden_size"),
    "dropout": ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout", "resid_dropout"),
}


@dataclasses.dataclass(frozen=True)
class ConfigParam:
    """A constructor parameter that takes a config object, and the way to build one."""

    name: str  # the constructor's parameter
    cls: type | None  # the config class; None: an attribute bag (types.SimpleNamespace)
    fields: tuple[str, ...]  # the fields it has (a dataclass's, __init__'s keywords, or those the source reads)
    required: tuple[str, ...]  # fields with no default


def config_param(factory: Callable) -> ConfigParam | None:
    """The factory's one required parameter that takes a config object, if it has one."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    required = [p for p in params.values() if p.default is inspect.Parameter.empty and p.name not in LAYER_INDEX
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) != 1:
        return None
    param = required[0]
    cls = annotation(factory, param.name)
    if cls is None and param.name not in CONFIG_PARAMS:
        return None
    if cls is None:
        cls = module_config_class(factory, param.name)
    if cls is not None and not config_like(cls):
        return None
    if cls is None or not own_fields(cls)[0]:  # an attribute bag: the fields its module's code reads
        read = fields_read(factory, param.name)
        return ConfigParam(param.name, cls if cls is not None and accepts_any(cls) else None, read, ()) if read else None
    names, required_fields = own_fields(cls)
    return ConfigParam(param.name, cls, names, required_fields)


def annotation(factory: Callable, name: str) -> type | None:
    """The parameter's annotated class, string annotations (from __future__ import annotations) resolved."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hint = typing.get_type_hints(target).get(name)
    except Exception:  # noqa: BLE001 - an annotation naming something not importable: treat as unannotated
        hint = None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[Config]
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
    return hint if inspect.isclass(hint) else None


def config_like(cls: type) -> bool:
    """A class tblock can build from fields: not a tensor, a module, a number or a container."""
    import torch

    if cls in (int, float, str, bool, dict, list, tuple) or issubclass(cls, (torch.Tensor, torch.nn.Module)):
        return False
    return dataclasses.is_dataclass(cls) or hasattr(cls, "from_dict") or hasattr(cls, "from_name") or \
        bool(own_fields(cls)[0]) or accepts_any(cls)


def module_config_class(factory: Callable, name: str) -> type | None:
    """The config class of an unannotated `config` parameter: among the dataclasses and the classes named like a
    config (`*Config`, `*Args`, `CfgNode`) its module defines, the one with every field the factory's own code reads
    (nanoGPT's GPTConfig for its Block), a dataclass preferred."""
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    if module is None:
        return None
    try:
        source = inspect.getsource(factory)
    except (OSError, TypeError):
        source = ""
    read = set(re.findall(rf"\b{re.escape(name)}\.([A-Za-z_]\w*)\b(?!\s*\()", source))
    own = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__
           and (dataclasses.is_dataclass(c) or re.search(r"(Config|Args|CfgNode)$", c.__name__))]
    covering = [c for c in own if accepts_any(c) or read <= set(own_fields(c)[0]) | set(dir(c))]
    for pick in (dataclasses.is_dataclass, lambda c: True):
        found = [c for c in covering if pick(c)]
        if len(found) == 1:
            return found[0]
    return None


def own_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every field, the fields with no default) of a dataclass, or of a plain class's keyword __init__."""
    if dataclasses.is_dataclass(cls):
        fs = [f for f in dataclasses.fields(cls) if f.init]
        return (tuple(f.name for f in fs), tuple(f.name for f in fs if f.default is dataclasses.MISSING
                                                 and f.default_factory is dataclasses.MISSING))
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return (), ()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return tuple(p.name for p in named), tuple(p.name for p in named if p.default is inspect.Parameter.empty)


def accepts_any(cls: type) -> bool:
    """A class built from any keywords (minGPT's CfgNode(**kwargs))."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params) and not any(
        p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)


def fields_read(factory: Callable, name: str) -> tuple[str, ...]:
    """The attributes `name.X` that the factory's module reads (the constructor and the submodules it builds)."""
    module = inspect.getmodule(factory)
    try:
        source = inspect.getsource(module) if module is not None else inspect.getsource(factory)
    except (OSError, TypeError):
        return ()
    return tuple(dict.fromkeys(re.findall(rf"\b{re.escape(name)}\.([A-Za-z_]\w*)\b(?!\s*\()", source)))


def config_values(param: ConfigParam, flags: dict, aliases: dict[str, tuple[str, ...]], extra: dict
                  ) -> tuple[dict, list[str]]:
    """The fields to build the config with: flags under the config's own names, placeholders for required fields,
    --kwargs last; and the canonical flags no field takes."""
    values, unreached = {}, []
    for canonical, value in flags.items():
        names = aliases.get(canonical, (canonical,)) + MORE_ALIASES.get(canonical, ())
        named = [n for n in names if n in param.fields]
        bag = param.cls is None or accepts_any(param.cls)  # a bag takes every name its code reads
        for n in named if canonical == "dropout" or bag else named[:1]:  # minGPT: attn_pdrop, resid_pdrop and embd_pdrop
            values[n] = value
        if not named:
            unreached.append(canonical)
    for f in param.required:
        if f not in values and f in PLACEHOLDERS:
            values[f] = PLACEHOLDERS[f]
    if param.cls is None or accepts_any(param.cls):  # a bag: only what the code reads, with the placeholders
        values.update({f: v for f, v in PLACEHOLDERS.items() if f in param.fields and f not in values})
    return {**values, **extra}, unreached


def build_config_object(param: ConfigParam, values: dict, given: set | frozenset = frozenset()):
    """The config object: `from_name(name, **fields)` when --kwargs names a preset, the class's own constructor for a
    dataclass or keyword class, `from_dict` otherwise, an attribute bag where no class is known. `given`: the --kwargs
    keys, which stand as the user wrote them."""
    cls = param.cls
    if cls is None:
        return types.SimpleNamespace(**values)
    preset = _preset(cls, values, param.fields, given)
    if preset is not None:
        fields = {**kv_heads_scaled(preset, values, given), **{k: v for k, v in values.items() if k != "name"}}
        try:
            return cls.from_name(values["name"], **fields)
        except TypeError:  # a from_name(name) that takes no overrides (gpt-fast): the preset, then the fields
            return dataclasses.replace(preset, **fields) if dataclasses.is_dataclass(preset) else _set(preset, fields)
    if dataclasses.is_dataclass(cls) or own_fields(cls)[0] or accepts_any(cls):
        return cls(**values)
    return cls.from_dict(values)


def _preset(cls, values: dict, fields, given):
    """The preset `from_name(name)` returns when a name is given and the class has presets (litgpt's Config, whose
    `name` is also a field: a name it has no preset for is then just a field); else None."""
    if "name" not in values or not callable(getattr(cls, "from_name", None)):
        return None
    if "name" not in fields:
        return cls.from_name(values["name"])
    if "name" not in given:
        return None
    try:
        return cls.from_name(values["name"])
    except (ValueError, KeyError, StopIteration):
        return None


def kv_heads_scaled(preset, values: dict, given) -> dict:
    """A preset's key/value head count scaled with the query heads the flags set, the preset's grouping kept (a 7B
    preset's 32 kv heads of 32 become 4 of 4; Llama-3.2-1B's 8 of 32 become 1 of 4), unless --kwargs sets it."""
    heads_field = next((n for n in HEADS if n in values and isinstance(getattr(preset, n, None), int)), None)
    if heads_field is None:
        return {}
    old, new = getattr(preset, heads_field), values[heads_field]
    scaled = {}
    for n in KV_HEADS:
        kv = getattr(preset, n, None)
        if n in given or not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or old % kv:
            continue
        groups = max(1, new // (old // kv))  # query heads per kv head as the preset has them
        scaled[n] = groups if new % groups == 0 else new
    return scaled


def _set(obj, fields: dict):
    for k, v in fields.items():
        setattr(obj, k, v)
    return obj


def read_back(obj, aliases: dict[str, tuple[str, ...]], flags: dict) -> list[tuple[str, object, object]]:
    """(flag, asked, built) for each size the built config holds at another value than the flag asked for (a
    __post_init__ that derives it, a preset that fixes it)."""
    changed = []
    for canonical in ("d_model", "n_heads", "d_ff"):
        if canonical not in flags:
            continue
        names = aliases[canonical] + MORE_ALIASES.get(canonical, ())
        got = next((getattr(obj, n) for n in names if isinstance(getattr(obj, n, None), int)), None)
        if got is not None and got != flags[canonical]:
            changed.append((canonical, flags[canonical], got))
    return changed
