"""Build an hf:TYPE model of tblock's sizes (after a memory gate on its parameter count) and wrap its layers."""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch
import torch.nn as nn

from tblock_cli import runtime
from tblock_cli.config import BlockConfig
from tblock_cli.errors import ConfigError, LoadError, TBlockError, is_out_of_memory
from tblock_cli.probes import cast
from tblock_cli.subject.hf import families, sizes
from tblock_cli.subject.hf.drive import HFLayers
from tblock_cli.subject.through import is_causal, positional

STACKS = ("encoder", "decoder")
def build_config(model_type: str, cfg: BlockConfig, extra: dict):
    """The type's default config with tblock's sizes in every field that depends on them; --kwargs override."""
    defaults = sizes.default_config(model_type)
    extra = sizes.legacy_rope(defaults, {k: v for k, v in extra.items() if k not in sizes.DRIVER_KEYS})
    sizes.validate_kwargs(model_type, defaults, extra)
    overrides = {**sizes.size_overrides(defaults, cfg, extra), **families.family_overrides(model_type, defaults, cfg, extra),
                 **extra}
    try:
        config = type(defaults)(**{**_init_fields(defaults), **overrides})
    except Exception as e:  # noqa: BLE001 - the config class rejects a combination: say which
        raise LoadError(f"--block hf:{model_type}: its config rejects these sizes: {sizes.one_line(e)}") from None
    for k, v in overrides.items():  # fields a constructor does not take as arguments
        if sizes.settable(config, k) and getattr(config, k, None) != v:
            try:
                setattr(config, k, v)
            except Exception as e:  # noqa: BLE001
                raise LoadError(f"--block hf:{model_type}: cannot set {k}={v!r}: {sizes.one_line(e)}") from None
    return config


def _init_fields(config) -> dict:
    """The default config's own values, without derived or bookkeeping entries a constructor refuses."""
    d = config.to_dict()
    # out_features / out_indices name backbone stages by layer number (dinov2's 'stage12'): recomputed from the layers
    for k in ("model_type", "transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype",
              "out_features", "out_indices", "stage_names"):
        d.pop(k, None)
    return {k: v for k, v in d.items() if sizes.settable(config, k)}


def _parameter_count(config) -> int:
    """Parameters of the model this config builds, counted on the meta device: shapes, no storage."""
    with torch.device("meta"):
        return sum(p.numel() for p in _model(config).parameters())


def _model(config) -> nn.Module:
    """AutoModel for the config; a composite model's part (AlignTextConfig) that AutoModel does not map is built
    by its own class, named after its config class in the family's modeling module."""
    import importlib

    from transformers import AutoModel

    from tblock_cli.subject.hf.init import from_config_once

    if getattr(config, "architectures", None) is None:  # AutoModel iterates it for types mapped to two classes (funnel)
        config.architectures = []
    try:
        return from_config_once(AutoModel, config)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        cls = getattr(module, type(config).__name__.replace("Config", "Model"), None)
        if cls is None:
            raise
        return cls(config)


def _stack(model_type: str, base: nn.Module, config, which: str | None) -> nn.Module:
    encdec = getattr(config, "is_encoder_decoder", False)
    if which is not None and which not in STACKS:
        raise ConfigError(f"--kwargs stack: must be 'encoder' or 'decoder', got {which!r}")
    if not encdec:
        if which is not None:
            raise ConfigError(f"--kwargs stack: hf:{model_type} has one layer stack, no encoder and decoder")
        return base
    stack = getattr(base, which or "encoder", None)
    if stack is None:
        raise LoadError(f"--block hf:{model_type}: found no {which or 'encoder'} stack in {type(base).__name__}")
    return stack


def build(model_type: str, cfg: BlockConfig, extra: dict) -> HFLayers:
    """The wrapped layers of a randomly initialised TYPE model of tblock's sizes (seeded by --seed).
    Any failure while building is a one-line load error."""
    try:
        return _build(model_type, cfg, extra)
    except TBlockError:
        raise
    except Exception as e:  # noqa: BLE001 - the model rejects these sizes or cannot run them: say which, exit 2
        if is_out_of_memory(e):
            raise
        raise LoadError(f"--block hf:{model_type}: building or driving the model failed: {sizes.one_line(e)}") from None


def _part(model_type: str, extra: dict) -> tuple[str, dict]:
    """A composite model (vision-language, audio-language): the model type of its text part, or of the part
    --kwargs '{"stack": NAME}' names (vision, audio, ...); any other type as it is."""
    defaults = sizes.default_config(model_type)
    if any(isinstance(getattr(defaults, n, None), int) for n in sizes.LAYERS):
        return model_type, extra
    parts = {k[: -len("_config")]: v for k, v in vars(defaults).items() if k.endswith("_config") and hasattr(v, "model_type")}
    if not parts:
        return model_type, extra
    which = extra.get("stack") or ("text" if "text" in parts else next(iter(parts)))
    if which not in parts:
        raise ConfigError(f"--kwargs stack: hf:{model_type} has the parts {', '.join(parts)}, not {which!r}")
    return parts[which].model_type, {k: v for k, v in extra.items() if k != "stack"}


def _span(cfg: BlockConfig) -> tuple[int, int]:
    """The layers driven: --layer N (0 by default) and the --layers after it."""
    first = cfg.layer or 0
    return first, first + cfg.layers - 1


def _build(model_type: str, cfg: BlockConfig, extra: dict) -> HFLayers:
    sizes.import_transformers()
    model_type, extra = _part(model_type, extra)
    span = _span(cfg)
    config = build_config(model_type, replace(cfg, layers=span[1] + 1), extra)  # a model of N + --layers layers
    if "attn_implementation" in extra:
        config._attn_implementation = extra["attn_implementation"]
    # The gate before any weight exists: weights, their gradients and check's float64 copy (8 bytes each).
    item = runtime.DTYPES[cfg.dtype].itemsize
    n = _parameter_count(config)
    runtime.ensure_fits(n * (2 * item + 8) + runtime.PROCESS_BYTES, runtime.resolve_device(cfg.device), f"hf:{model_type}")
    torch.manual_seed(cfg.seed)
    base = _model(config).eval()
    which = extra.get("stack")
    stack = _stack(model_type, base, config, which)
    n_layers = _layer_count(config, which)
    path, layers = families.find_layers(model_type, stack, n_layers)
    stack = _entry(stack, path, layers)
    memory = None
    if which == "decoder":  # cross-attention reads a fixed encoder output, the same for every sample
        memory = torch.randn(1, cfg.seq, cfg.d_model, generator=torch.Generator().manual_seed(cfg.seed))
    module = HFLayers(model_type, config, stack, layers, _within(span, layers, model_type), memory)
    try:
        module.causal = is_causal(module, cfg.d_model)
    except RuntimeError as e:
        if getattr(config, "_experts_implementation", "eager") == "eager" or "stride" not in str(e):
            raise
        # CPU grouped_mm wants 16-byte aligned expert strides, which small expert widths miss; the eager
        # experts loop computes the same function
        config._experts_implementation = "eager"
        module.causal = is_causal(module, cfg.d_model)
    module.positional = positional(module, base, cfg.d_model)
    module.by_design = families.by_design(model_type, module.layers, config)
    module.warnings = _unreached(model_type, module, cfg)
    return module


def rebuilder(model_type: str, cfg: BlockConfig, extra: dict, like: HFLayers, dtype: torch.dtype):
    """The layers built anew at another seed, on the CPU or the meta device, as `like` was (Subject.rebuild): the
    model's constructor only, none of build's probe forwards (a meta build cannot run); what they found is copied."""
    def rebuild(seed: int, where: str) -> HFLayers:
        part, rest = _part(model_type, extra)
        config = build_config(part, replace(cfg, layers=_span(cfg)[1] + 1), rest)
        for name in ("_attn_implementation", "_experts_implementation"):
            if hasattr(like.config, name):
                setattr(config, name, getattr(like.config, name))
        torch.manual_seed(seed)
        with torch.device(where):
            base = _model(config).eval()
        which = rest.get("stack")
        stack = _stack(part, base, config, which)
        path, layers = families.find_layers(part, stack, _layer_count(config, which))
        module = HFLayers(part, config, _entry(stack, path, layers), layers, like.span, like.memory)
        module.causal, module.positional, module.by_design, module.warnings = like.causal, like.positional, like.by_design, like.warnings
        return cast(module, dtype)
    return rebuild


def _within(span: tuple[int, int], layers, model_type: str) -> tuple[int, int]:
    if span[1] >= len(layers):
        raise LoadError(f"--block hf:{model_type} --layer {span[0]}: the model has {len(layers)} layer(s)")
    return span


def _entry(stack: nn.Module, path: str, layers: nn.ModuleList) -> nn.Module:
    """What tblock calls: the stack when its forward takes inputs_embeds; else the module holding the layers when
    its forward takes hidden states (vision encoders: the patch embedding is left out); else the layers in a row,
    each given no mask, as whisper's encoder calls them."""
    if "inputs_embeds" in inspect.signature(stack.forward).parameters:
        return stack
    owner = stack.get_submodule(path.rpartition(".")[0]) if "." in path else stack
    params = list(inspect.signature(owner.forward).parameters)
    if params and params[0] == "hidden_states":
        return owner
    return InOrder(layers)


class InOrder(nn.Module):
    """Layers called one after another on hidden states with no mask: for stacks whose forward starts from raw
    features (whisper's mel frames), which pass their encoder layers no attention mask either."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        for layer in self.layers:
            params = inspect.signature(layer.forward).parameters
            kw = {"attention_mask": None} if "attention_mask" in params else {}
            hidden_states = layer(hidden_states, **kw)
            hidden_states = hidden_states[0] if isinstance(hidden_states, (tuple, list)) else hidden_states
        return hidden_states


def _layer_count(config, which: str | None) -> int:
    names = {"decoder": ("decoder_layers", "num_decoder_layers"), "encoder": ("encoder_layers", "num_layers")}.get(which or "", ())
    order = (*names, "num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers")
    if isinstance(getattr(type(config), "num_hidden_layers", None), property) and isinstance(getattr(config, "num_layers", None), int):
        order = (*names, "num_layers")  # longcat_flash: num_hidden_layers = 2 x num_layers sublayer pairs, one module each
    for n in order:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0:
            return v
    raise LoadError(f"--block hf:{config.model_type}: its config names no layer count")


def _unreached(model_type: str, module: HFLayers, cfg: BlockConfig) -> tuple[str, ...]:
    """Flags that did not reach the built layers, read back from their modules' real widths."""
    out = []
    widths = set()
    for m in module.layers.modules():
        if isinstance(m, nn.Linear):
            widths.update((m.in_features, m.out_features))
        for p in m.parameters(recurse=False):
            widths.update(p.shape)
    if cfg.d_ff is not None and not ({cfg.d_ff, 2 * cfg.d_ff} & widths):
        named = any(n in module.config.to_dict() for n in sizes.FFN + sizes.EXPERT_FFN)
        out.append(f"--d-ff {cfg.d_ff} does not reach hf:{model_type}: " + (
            "no projection of that width in its layers (pass its FFN width field with --kwargs)" if named else
            "its config has no FFN width (its layers have no FFN of their own)"))
    heads = {getattr(m, n) for m in module.layers.modules() if "attention" in type(m).__name__.lower()
             for n in ("num_heads", "num_attention_heads", "n_head", "n_heads") if isinstance(getattr(m, n, None), int)}
    if heads and cfg.n_heads not in heads:
        out.append(f"--n-heads {cfg.n_heads} does not reach hf:{model_type}: its attention has {sorted(heads)} heads")
    if cfg.dropout not in (0, BlockConfig.dropout) and not any(isinstance(v, float) and v == cfg.dropout and any(w in k for w in sizes.DROPOUT_WORDS)
                                   for k, v in module.config.to_dict().items()):
        out.append(f"--dropout {cfg.dropout} does not reach hf:{model_type}: its config has no dropout field")
    return tuple(out)
