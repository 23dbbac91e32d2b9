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
from torch.overrides import TorchFunctionMode

from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, LoadError, is_out_of_memory, one_line
from tblock_cli.probes import cast, reseed
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
# The most positions tblock decodes through a model's own cache: the cache and its mask are allocated at this length
# (Llama-3.2's 131072-position block would want a 17 GB mask), and tblock's probes decode a few dozen.
DECODE_LENGTH = 4096
# The positions a decoding cache is first set up for; it doubles when decoding needs more.
DECODE_START = 64
# The spread of the values tblock gives parameters a model's constructor allocates and never writes: GPT-2's init.
INIT_STD = 0.02


@dataclass
class Cache:
    """tblock's decode handle for a cache that lives inside the model: the next position, the cache's tensors while
    another sequence has the model, and the bytes the cache holds for the positions filled."""

    batch: int
    position: int = 0
    length: int = 0  # positions the caches were set up for
    saved: list | None = None
    held_bytes: int = 0


def sized(factory, extra: dict, layers: int, heads: int) -> dict:
    """Fields that make the model small, under the names its config or builder uses; --kwargs keep theirs. Required
    ones with no default get placeholders (a builder's `max_seq_len`), key/value heads as many as the query heads."""
    from tblock_cli.subject import configs

    param = configs.config_param(factory)
    try:
        if param is not None:
            names, required = set(param.fields), set(param.required)
        else:
            params = inspect.signature(factory).parameters
            names = set(params)
            required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    except (TypeError, ValueError):
        names, required = set(), set()
    out = {}
    for group, value in ((LAYER_COUNTS, layers), (VOCABS, VOCAB)):
        name = next((n for n in group if n in names), None)
        if name is not None and not any(n in extra for n in group):
            out[name] = value
    for name in required - set(extra) - set(out):
        if name in configs.PLACEHOLDERS:
            out[name] = configs.PLACEHOLDERS[name]
        elif name in configs.KV_HEADS:
            out[name] = heads
    if param is not None and param.cls is None and "model_type" in names and "model_type" not in extra:
        out["model_type"] = None  # an attribute bag's preset selector (minGPT's): the fields, not a preset
    return out


class Writes(TorchFunctionMode):
    """The storages torch operations write while a model is built: factory results with defined values, in-place
    targets and `out=` tensors; `torch.empty` (and the legacy `torch.Tensor(n, m)`, no operation at all) write nothing.

    A model meant to be loaded from a checkpoint may leave weights as allocated (Meta's llama hands fairscale's
    parallel layers an identity `init_method`): memory nothing wrote holds whatever was there before, and a layer
    of it would make every check a coin toss. Such parameters get seeded values (`initialise_unwritten`).
    """

    EMPTY = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        targets = [kwargs.get("out")]
        if name.endswith("_") and not name.startswith("_") and name != "requires_grad_" and args:
            targets.append(args[0])
        if func not in self.EMPTY:
            targets.extend(out if isinstance(out, (tuple, list)) else [out])
        for t in targets:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.written.add(t.untyped_storage().data_ptr())
        return out

    def initialise_unwritten(self, model: nn.Module) -> None:
        """Parameters no operation wrote, given normal(0, INIT_STD) values."""
        with torch.no_grad():
            for p in model.parameters():
                # trainable ones only: a frozen table made from numpy (torch.from_numpy is no torch function, so
                # unseen here) is data, not memory left as allocated
                if p.device.type != "meta" and p.is_floating_point() and p.numel() and p.requires_grad and \
                        p.untyped_storage().data_ptr() not in self.written:
                    p.normal_(0.0, INIT_STD)


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
        self.causal = False
        self.positional = False
        self.by_design: dict[str, str] = {}

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
        if not decoding and conv is not None and not conv.always and conv.tensors(model):
            conv.release(model)  # a full forward runs as the model runs without a cache
        cached = conv is not None and (conv.always or decoding)
        kwargs = {}
        if cached:
            if not decoding:
                conv.prepare(model, B, T)
            kwargs = conv.forward_kwargs(model, start, T, B, x.device)
            caches.writable(model, conv)
        caches.detach_state(model)  # a training forward's in-place cache writes must not chain graphs across calls
        ids = torch.zeros(B, T, dtype=torch.long, device=x.device)
        call = lambda: self.call_forward(model, ids, **kwargs)  # noqa: E731
        try:
            return drive(call, self._all[self.span[0]], self._all[self.span[1]], x, before=self._all[0], model=model)
        finally:
            if cached:  # caches the model's forward insists on are tblock's way in, not state the layer trains with
                caches.detach_state(model)

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
            self.__dict__["_active"] = cache
            self._room(cache, cache.position + n, cache.saved)
            cache.saved = None
        elif cache.position + n > cache.length:
            self._room(cache, cache.position + n, caches.snapshot(model, conv))
        y = self.run(x, cache.position, decoding=True)
        cache.position += n
        cache.held_bytes = caches.held_bytes(model, conv, cache.position)
        return y, cache

    def _room(self, cache: Cache, need: int, saved: list | None) -> None:
        """Caches set up for the sequence at hand, long enough for `need` positions: a cache of the model's full
        length would make every step attend over thousands of masked positions, so it starts at DECODE_START and
        doubles as decoding goes (its positions so far carried over)."""
        if need > self.max_length:
            raise ValueError(f"{self.model_name}'s cache holds {self.max_length} positions; decoding asks for {need}")
        if need > cache.length:
            cache.length = min(self.max_length, max(need, 2 * cache.length, DECODE_START))
        self.convention.prepare(self._model, cache.batch, cache.length)
        if saved is not None:
            caches.restore(self._model, self.convention, saved)

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
    """The positions decoding can use: the longest sequence the model's config names (its rotary table, its cache),
    else a default; at most DECODE_LENGTH."""
    found = _config_int(model, MAX_LENGTHS)
    return min(found, DECODE_LENGTH) if found is not None else DEFAULT_MAX_LENGTH


def _config_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    """A positive count the model's config (under the names models give it: config, params, args) or the model itself
    holds under one of `names`."""
    for holder in (getattr(model, "config", None), getattr(model, "params", None), getattr(model, "args", None), model):
        for n in names:
            v = getattr(holder, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def build(spec: str, factory, cfg: BlockConfig, extra: dict, layer: int, notes: list | None = None, *,
          where: str | None = None) -> ModelLayers:
    """Layers layer..layer+cfg.layers-1 of the model SPEC builds, wrapped; probed for what the model does (causal,
    positions) unless built on the meta device (`where`), where nothing can run."""
    from tblock_cli.subject.loading import construct

    count = layer + cfg.layers
    caches.model_parallel_world(factory)
    reseed(cfg.seed)
    writes = Writes()
    with contextlib.redirect_stdout(sys.stderr), (torch.device(where) if where else contextlib.nullcontext()), writes:
        model = construct(spec, factory, cfg, {**sized(factory, extra, count, cfg.n_heads), **extra}, notes)
    writes.initialise_unwritten(model)  # construct refused anything but a module
    try:
        path, layers = find_layers(model, _config_int(model, LAYER_COUNTS))
    except LoadError as e:
        raise LoadError(f"--block {spec} --layer {layer}: {e}") from None
    if layer + cfg.layers > len(layers):
        raise LoadError(f"--block {spec} --layer {layer}: the model has {len(layers)} layer(s) in {path or 'its stack'}"
                        + (f" (--layers {cfg.layers} from there)" if cfg.layers > 1 else ""))
    module = ModelLayers(spec, model.eval(), layers, (layer, layer + cfg.layers - 1), caches.recognise(model),
                         max_length(model))
    if where != "meta":
        try:
            module.causal = is_causal(module, cfg.d_model)
            module.positional = positional(module, model, cfg.d_model)
        except USER_ERRORS as e:
            if is_out_of_memory(e):
                raise
            raise LoadError(f"--block {spec} --layer {layer}: driving the model's forward on token ids failed: "
                            f"{one_line(e)}") from None
    return module


def reaches(module: ModelLayers, flag: str, cfg: BlockConfig) -> bool:
    """Whether a size flag the model's config names no field for reached its layers anyway (nanoGPT's FFN is
    4 x n_embd by its code, so --d-ff 256 at --d-model 64 does): a weight matrix of that width, a fused GLU's too."""
    if flag != "d_ff":
        return False
    widths = {w for p in module.layers.parameters() if p.dim() == 2 for w in p.shape}  # Linear or a parallel one
    return bool({cfg.ffn_dim, 2 * cfg.ffn_dim} & widths)


def rebuilder(spec: str, factory, cfg: BlockConfig, extra: dict, layer: int, like: ModelLayers, dtype: torch.dtype):
    """The layers built anew at another seed, on the CPU or the meta device, as `like` was (Subject.rebuild)."""
    def rebuild(seed: int, where: str) -> ModelLayers:
        module = build(spec, factory, replace(cfg, seed=seed), extra, layer, where=where)
        module.causal, module.positional, module.by_design = like.causal, like.positional, like.by_design
        conv = like.convention
        shape = caches.prepared(like._model) if conv is not None and conv.tensors(like._model) else None
        if shape is not None:  # caches that are buffers belong to the state_dict: a fresh copy holds the same ones
            module.convention.prepare(module._model, *shape)
        return cast(module, dtype)
    return rebuild
