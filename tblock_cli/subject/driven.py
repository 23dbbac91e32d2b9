"""A layer of any model over token ids, driven by the model's own forward: `--block MODEL_SPEC --layer N`.

The model is built small (its config from tblock's flags, one layer more than N needs, a small vocabulary), its
forward called on placeholder token ids; `through.drive` swaps tblock's hidden states in at layer N and stops after
the last layer asked for. Masks, rotary tables, positions and the layer's own call signature all come from the
model; a library's KV-cache convention (`caches`) is followed where the model needs it, and for decoding.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from tblock_cli.config import BlockConfig
from tblock_cli.errors import LoadError
from tblock_cli.subject import caches
from tblock_cli.subject.through import drive, is_causal, positional

# A model's layer count under the names configs and builders give it: the model is built with the layers asked for.
LAYER_COUNTS = ("n_layer", "n_layers", "num_layers", "num_hidden_layers", "depth")
# Its vocabulary: placeholder ids are all 0, so a small one keeps the embedding and output head from dwarfing a layer.
VOCABS = ("vocab_size", "n_vocab")
VOCAB = 256
# Its longest sequence, where the config names it: what decoding through the model's own cache can hold.
MAX_LENGTHS = ("max_seq_len", "max_seq_length", "block_size", "context_length", "max_position_embeddings")
DEFAULT_MAX_LENGTH = 2048


@dataclass
class Cache:
    """tblock's decode handle for a cache that lives inside the model: the next position, the cache's tensors while
    another sequence has the model, and the bytes the cache holds for the positions filled."""

    batch: int
    position: int = 0
    saved: list | None = None
    held_bytes: int = 0


def sized(factory, extra: dict, layers: int) -> dict:
    """Fields that make the model small, under the names its config or builder uses; --kwargs keep theirs."""
    from tblock_cli.subject import configs

    param = configs.config_param(factory)
    try:
        names = set(param.fields) if param is not None else set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        names = set()
    out = {}
    for group, value in ((LAYER_COUNTS, layers), (VOCABS, VOCAB)):
        name = next((n for n in group if n in names), None)
        if name is not None and not any(n in extra for n in group):
            out[name] = value
    if param is not None and param.cls is None:  # an attribute bag: every field its code reads and tblock has no
        out.update({f: None for f in param.fields if f == "model_type" and f not in extra})  # minGPT: no preset
    return out


class ModelLayers(nn.Module):
    """Layers first..last of a model over token ids, called through the model's forward; (B, T, d) in and out.

    Only the layers are this module's parameters: the embedding, final norm and head the model holds are not the
    block's. The model moves, trains and evaluates with the layers.
    """

    def __init__(self, name: str, model: nn.Module, all_layers, span: tuple[int, int], convention=None,
                 max_length: int = DEFAULT_MAX_LENGTH):
        super().__init__()
        self.model_name = name
        self.layers = nn.ModuleList(list(all_layers)[span[0] : span[1] + 1])
        self.__dict__["_model"], self.__dict__["_all"], self.__dict__["_active"] = model, list(all_layers), None
        self.span, self.convention, self.max_length = span, convention, max_length
        self.call_forward = _undecorated(type(model).forward)
        params = list(inspect.signature(self.call_forward).parameters)
        self.entry = params[1] if len(params) > 1 else None  # after self: the token ids
        self.causal = False
        self.positional = False
        self.by_design: dict[str, str] = {}
        self.warnings: tuple[str, ...] = ()
        self.pad_keyword = None  # a model over token ids takes its mask from its own code

    def _apply(self, fn, recurse=True):
        self._model._apply(fn, recurse)  # rotary tables, masks and caches move with the layers
        super()._apply(fn, recurse)
        return self

    def train(self, mode: bool = True):
        self._model.train(mode)
        return super().train(mode)

    def run(self, x: torch.Tensor, start: int = 0, decoding: bool = False) -> torch.Tensor:
        """Layers first..last on x (positions start.. onwards) through the model's forward."""
        B, T, _ = x.shape
        model, conv = self._model, self.convention
        if not decoding and self._active is not None:  # a full forward overwrites in-place caches: keep the sequence's
            self._active.saved = caches.snapshot(model, conv)
            self.__dict__["_active"] = None
            conv.release(model)
        kwargs = {}
        if conv is not None and (conv.always or decoding):
            if not decoding:
                conv.prepare(model, B, T)
            kwargs = conv.forward_kwargs(model, start, T, B, x.device)
        caches.detach_state(model)  # a training forward's in-place cache writes must not chain graphs across calls
        ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        call = lambda: self.call_forward(model, ids, **kwargs)  # noqa: E731
        return drive(call, self._all[self.span[0]], self._all[self.span[1]], x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    @property
    def decodes(self) -> bool:
        """Whether the model keeps a KV cache by a convention tblock follows (kvcache.has_decode reads it)."""
        return self.convention is not None

    def decode(self, x: torch.Tensor, cache: Cache | None = None):
        """tblock's decode protocol through the cache the model keeps itself, by its library's convention."""
        if not self.causal:
            raise ValueError(f"{self.model_name} is bidirectional: its outputs change as tokens arrive, no cached decoding")
        conv, model = self.convention, self._model
        if conv is None:
            raise ValueError(f"{self.model_name} keeps no KV cache tblock recognises ({caches.RECOGNISED})")
        B, n, _ = x.shape
        if cache is None or cache is not self._active:
            if self._active is not None:
                self._active.saved = caches.snapshot(model, conv)
            cache = cache if cache is not None else Cache(B)
            conv.prepare(model, cache.batch, self.max_length)
            if cache.saved is not None:
                caches.restore(model, conv, cache.saved)
                cache.saved = None
            self.__dict__["_active"] = cache
        if cache.position + n > self.max_length:
            raise ValueError(f"{self.model_name}'s cache holds {self.max_length} positions; decoding asks for "
                             f"{cache.position + n}")
        y = self.run(x, cache.position, decoding=True)
        cache.position += n
        cache.held_bytes = caches.held_bytes(model, conv, cache.position)
        return y, cache

    def single_layers(self) -> list["ModelLayers"]:
        """One wrapper per layer, each driven by the same model forward (for depth's per-layer view)."""
        out = []
        for i in range(self.span[0], self.span[1] + 1):
            one = ModelLayers(self.model_name, self._model, self._all, (i, i), self.convention, self.max_length)
            one.causal, one.positional, one.by_design = self.causal, self.positional, self.by_design
            out.append(one)
        return out


def _undecorated(forward):
    """The forward under torch's grad-mode decorators (Meta's llama wraps it in @torch.inference_mode(), for serving):
    tblock measures gradients, so it calls the function itself; the model's code runs unchanged."""
    while hasattr(forward, "__wrapped__") and getattr(forward, "__code__", None) is not None and \
            forward.__code__.co_filename.replace("\\", "/").endswith("torch/utils/_contextlib.py"):
        forward = forward.__wrapped__
    return forward


def find_layers(model: nn.Module, expected: int | None) -> tuple[str, list[nn.Module]]:
    """The model's stack of layers: a ModuleList, Sequential or ModuleDict of one kind of module, as long as the
    layer count the model was built with, holding the most parameters per layer (the shallowest on a tie)."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            kids = list(m.children())
            if kids and all(type(k) is type(kids[0]) for k in kids):
                per = sum(p.numel() for p in kids[0].parameters())
                if per and (expected is None or len(kids) == expected):
                    found.append((per, -name.count("."), name, kids))
    if not found:
        raise LoadError("found no stack of layers in the model (a ModuleList, Sequential or ModuleDict of layers"
                        + (f", {expected} long" if expected else "") + ")")
    _, _, name, kids = max(found, key=lambda f: (f[0], f[1]))
    return name, kids


def max_length(model: nn.Module) -> int:
    """The longest sequence the model's config names (its rotary table, its cache), else a default."""
    for holder in (getattr(model, "config", None), getattr(model, "params", None), getattr(model, "args", None), model):
        for n in MAX_LENGTHS:
            v = getattr(holder, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return DEFAULT_MAX_LENGTH


def build(spec: str, factory, cfg: BlockConfig, extra: dict, layer: int, notes: list | None = None, *,
          where: str | None = None) -> ModelLayers:
    """Layers layer..layer+cfg.layers-1 of the model SPEC builds, wrapped; probed for what the model does (causal,
    positions) unless built on the meta device (`where`), where nothing can run."""
    from tblock_cli.subject.loading import construct

    count = layer + cfg.layers
    caches.model_parallel_world(factory)
    with contextlib.redirect_stdout(sys.stderr), (torch.device(where) if where else contextlib.nullcontext()):
        model = construct(spec, factory, cfg, {**sized(factory, extra, count), **extra}, notes)
    if not isinstance(model, nn.Module):
        raise LoadError(f"--block {spec}: it builds a {type(model).__name__}, not a torch.nn.Module")
    declared = _declared_count(model)
    try:
        path, layers = find_layers(model, declared if declared is not None else None)
    except LoadError as e:
        raise LoadError(f"--block {spec} --layer {layer}: {e}") from None
    if layer + cfg.layers > len(layers):
        raise LoadError(f"--block {spec} --layer {layer}: the model has {len(layers)} layer(s) in {path or 'its stack'}"
                        + (f" (--layers {cfg.layers} from there)" if cfg.layers > 1 else ""))
    module = ModelLayers(spec, model.eval(), layers, (layer, layer + cfg.layers - 1), caches.recognise(model),
                         max_length(model))
    if where != "meta":
        module.causal = is_causal(module, cfg.d_model)
        module.positional = positional(module, model, cfg.d_model)
    return module


def reaches(module: ModelLayers, flag: str, cfg: BlockConfig) -> bool:
    """Whether a size flag the model's config names no field for reached its layers anyway (nanoGPT's FFN is
    4 x n_embd by its code, so --d-ff 256 at --d-model 64 does): a projection of that width, a GLU's too."""
    if flag != "d_ff":
        return False
    widths = {w for m in module.layers.modules() if isinstance(m, nn.Linear) for w in (m.in_features, m.out_features)}
    return bool({cfg.ffn_dim, 2 * cfg.ffn_dim} & widths)


def _declared_count(model: nn.Module) -> int | None:
    for holder in (getattr(model, "config", None), getattr(model, "params", None), getattr(model, "args", None), model):
        for n in LAYER_COUNTS:
            v = getattr(holder, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def rebuilder(spec: str, factory, cfg: BlockConfig, extra: dict, layer: int, like: ModelLayers, dtype: torch.dtype):
    """The layers built anew at another seed, on the CPU or the meta device, as `like` was (Subject.rebuild)."""
    def rebuild(seed: int, where: str) -> ModelLayers:
        module = build(spec, factory, replace(cfg, seed=seed), extra, layer, where=where)
        module.causal, module.positional, module.by_design = like.causal, like.positional, like.by_design
        return module.to(dtype=dtype)
    return rebuild
