"""The KV caches of popular model libraries, recognised by what a model has and driven through the library's own API.

A layer driven through its model decodes through that model's cache: gpt-fast's `setup_caches` + `input_pos`, litgpt's
`set_kv_cache` + `input_pos`, torchtune's `setup_caches` + `mask` + `input_pos`, Meta's `start_pos` with per-layer
caches built in `__init__`. Each is a `Convention`: how to make the caches hold a batch of sequences, the forward
keywords for a run of positions, how to turn them off, and where the cache tensors live (for snapshots, so two
sequences can be decoded in turns through one model's in-place caches, and for the bytes they really hold).
Recognition reads method names, signatures and forward parameters, never class names: a copy of a library's model
under another name is recognised the same.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

# model -> (batch, length) of its last prepare: tblock's own record, kept off the user's object
_prepared: "weakref.WeakKeyDictionary[nn.Module, tuple[int, int]]" = weakref.WeakKeyDictionary()


def _params(fn) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _where(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype of the model's weights: its caches are made to match them."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return (p.device, p.dtype) if p is not None else (torch.device("cpu"), torch.get_default_dtype())


def _kv_cache_buffers(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The 4-D floating buffers of every module an attention holds as `kv_cache` (gpt-fast, litgpt and torchtune all
    keep their caches so; torchtune's integer `cache_pos` is a write pointer, not cached keys or values)."""
    out = []
    for m in model.modules():
        kv = getattr(m, "kv_cache", None)
        if isinstance(kv, nn.Module):
            out += [(kv, n) for n, b in kv.named_buffers(recurse=False) if b.dim() == 4 and b.is_floating_point()]
    return out


def _shape(model: nn.Module, conv: "Convention") -> tuple[int, int] | None:
    """(sequences, positions) the caches hold now; None when there are none."""
    found = conv.tensors(model)
    if not found:
        return None
    t = getattr(*found[0])
    return t.shape[0], t.shape[conv.position_axis]


@dataclass(frozen=True)
class Convention:
    """One library's way of decoding with a cache. Subclasses implement it; instances carry no state."""

    name: str  # shown to users and in docs
    always: bool  # True: the forward cannot run without it (gpt-fast's caches first, Meta's start_pos)
    position_axis: int  # the axis of a cache tensor that counts positions (batch is axis 0 in all of them)

    def prepare(self, model: nn.Module, batch: int, length: int) -> None:
        """Caches able to hold `length` positions for exactly `batch` sequences (set up anew when either changed); a
        one-line ValueError where the model cannot."""
        self._set_up(model, batch, length)
        _prepared[model] = (batch, length)

    def _set_up(self, model: nn.Module, batch: int, length: int) -> None:
        raise NotImplementedError

    def forward_kwargs(self, model: nn.Module, start: int, n: int, batch: int, device) -> dict:
        """The forward's keywords for positions start..start+n-1 (input_pos, start_pos, mask, ...), not the ids."""
        raise NotImplementedError

    def release(self, model: nn.Module) -> None:
        """Caches off again where the library has a way, so a plain forward runs as before."""

    def tensors(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """Where the cache tensors live: (module, attribute or buffer name)."""
        return _kv_cache_buffers(model)


class SetupCachesInputPos(Convention):
    """gpt-fast: `setup_caches(max_batch_size, max_seq_length)` before any forward; `forward(idx, input_pos)` with
    1-D positions; KV buffers (B, H_kv, S, D) written in place, whose batch must equal the call's."""

    def _set_up(self, model, batch, length):
        held = _shape(model, self)
        if held is not None and held[0] == batch and held[1] >= length:
            return
        setup = model.setup_caches
        # setup_caches returns early while its guards (attributes named as its parameters) say "big enough", and a
        # smaller batch is no use to buffers whose batch must equal the call's: the guards go back to "none yet"
        for name in _params(setup):
            if isinstance(getattr(model, name, None), int):
                setattr(model, name, -1)
        with torch.device(_where(model)[0]):  # the caches, rotary table and mask are made on the default device
            setup(batch, length)

    def forward_kwargs(self, model, start, n, batch, device):
        return {"input_pos": torch.arange(start, start + n, device=device)}


class SetKvCache(Convention):
    """litgpt: `set_kv_cache(batch_size, max_seq_length, device=, dtype=)`, `forward(idx, input_pos=,
    input_pos_maxp1=)`, `clear_kv_cache()`; without a cache its forward is a plain causal one."""

    def _set_up(self, model, batch, length):
        limit = getattr(model, "max_seq_length", None)
        if isinstance(limit, int) and length > limit:
            raise ValueError(f"the model's rotary tables reach {limit} positions (max_seq_length); {length} asked")
        if _shape(model, self) == (batch, length):
            return
        device, dtype = _where(model)
        kwargs = {"max_seq_length": length, "device": device, "dtype": dtype}
        model.set_kv_cache(batch, **{k: v for k, v in kwargs.items() if k in _params(model.set_kv_cache)})

    def forward_kwargs(self, model, start, n, batch, device):
        kwargs = {"input_pos": torch.arange(start, start + n, device=device)}
        if "input_pos_maxp1" in _params(model.forward):
            kwargs["input_pos_maxp1"] = start + n  # attention over the positions written so far, not the whole cache
        return kwargs

    def release(self, model):
        model.clear_kv_cache()


class SetupCachesMask(Convention):
    """torchtune: `setup_caches(batch_size, dtype, decoder_max_seq_len=)`, `reset_caches()`, `caches_are_enabled()`;
    with caches on, `forward(tokens, mask=(B, n, S) bool, input_pos=(B, n))`. Its caches write at their own pointer
    (`cache_pos`), not at `input_pos`: forward_kwargs moves the pointer to `start`, so positions mean one thing."""

    def _set_up(self, model, batch, length):
        if model.caches_are_enabled() and _shape(model, self) == (batch, length):
            return
        self.release(model)  # setup_caches skips attentions that already hold a cache
        device, dtype = _where(model)
        kwargs = {"decoder_max_seq_len": length} if "decoder_max_seq_len" in _params(model.setup_caches) else {}
        with torch.device(device):
            model.setup_caches(batch, dtype, **kwargs)

    def forward_kwargs(self, model, start, n, batch, device):
        held = _shape(model, self)
        if held is None:
            raise ValueError("the model's caches are not set up: prepare first")
        length = held[1]
        for m in model.modules():
            kv = getattr(m, "kv_cache", None)
            pointer = getattr(kv, "cache_pos", None)
            if isinstance(pointer, torch.Tensor):
                with torch.no_grad():
                    pointer.copy_(torch.arange(pointer.numel(), device=pointer.device) + start)
        rows = torch.arange(start, start + n, device=device)
        mask = torch.arange(length, device=device)[None, :] <= rows[:, None]  # (n, S), True = attend
        return {"mask": mask.expand(batch, n, length), "input_pos": rows.expand(batch, n)}

    def release(self, model):
        # torchtune's own delete_kv_caches does the same; written here so torchtune need not be imported
        for m in model.modules():
            if isinstance(getattr(m, "kv_cache", None), nn.Module):
                m.kv_cache = None
                if hasattr(m, "cache_enabled"):
                    m.cache_enabled = False


class StartPos(Convention):
    """Meta's llama: `forward(tokens, start_pos: int)`, caches `cache_k`/`cache_v` (max_batch_size, max_seq_len,
    H_kv, D) built in `__init__` as plain tensor attributes and always written."""

    def _set_up(self, model, batch, length):
        held = _shape(model, self)
        if held is None:
            raise ValueError("the model's forward takes start_pos but its layers hold no cache tensors")
        if batch > held[0] or length > held[1]:
            raise ValueError(f"the model's caches hold {held[0]} sequences of {held[1]} positions "
                             f"(max_batch_size, max_seq_len); {batch} x {length} asked")

    def forward_kwargs(self, model, start, n, batch, device):
        return {"start_pos": start}

    def tensors(self, model):
        # plain (unregistered) 4-D floating tensors: the caches; rotary tables are 2-D and masks made per call
        return [(m, k) for m in model.modules() for k, v in vars(m).items()
                if type(v) is torch.Tensor and v.dim() == 4 and v.is_floating_point()]


GPT_FAST = SetupCachesInputPos("setup_caches + input_pos (gpt-fast style)", always=True, position_axis=2)
LITGPT = SetKvCache("set_kv_cache + input_pos (litgpt style)", always=False, position_axis=2)
TORCHTUNE = SetupCachesMask("setup_caches + mask + input_pos (torchtune style)", always=False, position_axis=2)
META = StartPos("start_pos with per-layer caches (Meta llama style)", always=True, position_axis=1)
CONVENTIONS = (LITGPT, TORCHTUNE, GPT_FAST, META)
RECOGNISED = "; ".join(c.name for c in CONVENTIONS)  # for messages that say what a model without them lacks


def recognise(model: nn.Module) -> Convention | None:
    """The convention the model's methods and forward parameters follow; None for a model with no cache of its own
    (nanoGPT, minGPT)."""
    forward = _params(model.forward)
    setup = _params(getattr(model, "setup_caches", None)) if callable(getattr(model, "setup_caches", None)) else None
    if callable(getattr(model, "set_kv_cache", None)) and callable(getattr(model, "clear_kv_cache", None)) \
            and "input_pos" in forward:
        return LITGPT
    if setup is not None and "dtype" in setup and callable(getattr(model, "caches_are_enabled", None)) \
            and {"mask", "input_pos"} <= forward.keys():
        return TORCHTUNE
    if setup is not None and "dtype" not in setup and "input_pos" in forward:
        required = [p for p in setup.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                      p.POSITIONAL_OR_KEYWORD)]
        if len(required) == 2:  # (max_batch_size, max_seq_length)
            return GPT_FAST
    start = forward.get("start_pos")
    if start is not None and start.default is start.empty:
        return META
    return None


def snapshot(model: nn.Module, conv: Convention) -> list[torch.Tensor]:
    """Copies of every cache tensor, so another sequence can use the caches and this one come back later."""
    return [getattr(m, k).clone() for m, k in conv.tensors(model)]


def restore(model: nn.Module, conv: Convention, saved: list[torch.Tensor]) -> None:
    """The caches as `snapshot` saw them (written in place: the model's references to them stay valid). Caches set up
    longer since (decoding outgrew them) take the saved positions first."""
    where = conv.tensors(model)
    fits = len(where) == len(saved) and all(
        t.dim() == s.dim() and all(a == b or (i == conv.position_axis and a >= b) for i, (a, b) in enumerate(zip(t.shape, s.shape)))
        for t, s in ((getattr(m, k), s) for (m, k), s in zip(where, saved)))
    if not fits:
        raise ValueError("the caches were set up anew since this snapshot: restore needs the same shapes")
    for (m, k), s in zip(where, saved):
        t = getattr(m, k).narrow(conv.position_axis, 0, s.shape[conv.position_axis])
        # a cache replaced inside Meta's @torch.inference_mode forward is an inference tensor: written only there
        with torch.inference_mode() if t.is_inference() else torch.no_grad():
            t.copy_(s)


def writable(model: nn.Module, conv: Convention) -> None:
    """Caches made under `torch.inference_mode` (a decoding benchmark's) are inference tensors, which a forward
    outside that mode cannot write in place: outside it, such caches become ordinary copies of themselves."""
    if torch.is_inference_mode_enabled():
        return
    for m, k in conv.tensors(model):
        t = getattr(m, k)
        if isinstance(t, torch.Tensor) and t.is_inference():
            if k in m._buffers:
                m._buffers[k] = t.clone()
            else:
                m.__dict__[k] = t.clone()


def held_bytes(model: nn.Module, conv: Convention, positions: int, batch: int | None = None) -> int:
    """Bytes the caches hold for `positions` positions of `batch` sequences (the prepared batch by default): each
    cache tensor's bytes per sequence and position, so grouped-query caches count only the kv heads they store, and a
    cache allocated for more sequences (Meta's max_batch_size) counts the rows in use, and a sliding window's ring
    (litgpt's, sized min(length, window)) no more positions than it has."""
    if batch is None:
        batch = (prepared(model) or _shape(model, conv) or (0,))[0]
    total = 0
    for m, k in conv.tensors(model):
        t = getattr(m, k)
        length = t.shape[conv.position_axis]
        per = t.numel() * t.element_size() // (t.shape[0] * length)
        total += per * batch * min(positions, length)  # a sliding window's ring holds no more than its length
    return total


def prepared(model: nn.Module) -> tuple[int, int] | None:
    """(batch, length) the model's caches were last prepared for, if ever."""
    return _prepared.get(model)


def detach_state(model: nn.Module) -> None:
    """Every buffer and plain tensor attribute that carries an autograd graph replaced by its detached value: a
    training forward writes keys and values into the caches in place, and the next forward would chain its graph to
    this one's (a second backward then fails, or memory grows with every step)."""
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and b.grad_fn is not None:
                m._buffers[name] = b.detach()
        for name, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.grad_fn is not None:
                m.__dict__[name] = v.detach()


def _origin(value) -> str:
    """The module a name in a namespace comes from: its own name for a module, else its __module__."""
    return str((value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "")) or "")


def _namespace(owner) -> dict:
    """The globals the model's code runs with: its module's, or (a module loaded without a sys.modules entry) those
    of the function or constructor itself."""
    if inspect.ismodule(owner):
        return vars(owner)
    module = sys.modules.get(getattr(owner, "__module__", None) or "")
    if module is not None:
        return vars(module)
    code = owner if inspect.isfunction(owner) else getattr(owner, "__init__", None)
    return getattr(code, "__globals__", {})


def model_parallel_world(owner) -> bool:
    """A one-process model-parallel world (gloo, world size 1, fairscale's groups of one) where the model's module
    uses fairscale and none exists yet: fairscale's parallel layers ask for their group when built. A no-op for
    other models. `owner`: the model's class, builder function or module. True when the model uses fairscale."""
    if not any(_origin(v).startswith("fairscale") for v in _namespace(owner).values()):
        return False
    import torch.distributed as dist
    from fairscale.nn.model_parallel import initialize as fs_init

    if not dist.is_initialized():  # one rank: an in-process store, no rendezvous port to pick or leave listening
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not fs_init.model_parallel_is_initialized():
        with contextlib.redirect_stdout(io.StringIO()):  # fairscale prints its group sizes; tblock's stdout is its own
            fs_init.initialize_model_parallel(1)
    return True
