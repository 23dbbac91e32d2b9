"""Probe helpers shared by checks, depth, compare and distributed: tolerances, float64 comparisons, train/eval switching,
residual gain, dropout rates set or turned off."""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# tr(J)/n is estimated from Rademacher probes whose estimate has std ~ 1/sqrt(n) for n probed elements:
# 8 probes at check's default input (2 x 10 x 512 = 10,240 elements) put that std near 0.004, far from
# the residual check's 0.5 margin. Larger inputs need fewer probes for the same precision (each probe is
# one backward, 0.2 s at a 7B-size layer): probes = ceil(RESIDUAL_ELEMENTS / n), at most 8, at least 1.
RESIDUAL_PROBES = 8
RESIDUAL_ELEMENTS = 8 * 10_240

# Largest |difference| between two computations that should agree, relative to max(1, |reference|).
# float32 sums of a few hundred products carry ~1e-6 relative error; 1e-5 leaves a margin and is
# the tolerance issue #2 sets for the reference check. Half precisions have 10 (fp16) and 7 (bf16)
# mantissa bits: 2^-7 ~ 8e-3 and 2^-4 ~ 6e-2 cover a LayerNorm, an attention and an FFN in a row.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}


# nn.Module's own bookkeeping (hook dicts, the non-persistent buffer names): no state a forward reads. Skipping
# them makes the key 5x cheaper (0.6 -> 0.12 ms on a d_model 32 block; it is taken around every shared forward).
BOOKKEEPING = frozenset(vars(nn.Module())) - {"_parameters", "_buffers", "_modules", "training"}


def tensors(obj):
    """Every tensor in obj, and in the lists, tuples and dicts it holds."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors(o)


def held_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) for each tensor the block's modules keep (buffers, public attributes) that carries autograd
    history: an auxiliary loss kept from the last training forward, as fairseq's and DeepSpeed's MoE layers keep
    `l_aux`. deepcopy refuses such a tensor until the next forward."""
    out = []
    for name, m in module.named_modules():
        for k, v in [*m._buffers.items(), *((k, v) for k, v in vars(m).items() if not k.startswith("_"))]:
            out += [(f"{name}.{k}" if name else k, t) for t in tensors(v) if t.grad_fn is not None]
    return out


def module_copy(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """copy.deepcopy(module) (with memo), the tensors it keeps with autograd history (`held_tensors`) copied detached."""
    import copy

    held = {id(t): t.detach().clone() for _, t in held_tensors(module)}
    return copy.deepcopy(module, {**held, **(memo or {})})


def cast(module: nn.Module, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """module.to(device=device, dtype=dtype), complex tensors kept complex: Module.to casts a complex buffer
    (torchtitan's `freqs_cis`) to a real dtype by dropping its imaginary part. A complex tensor follows a float64 cast
    (complex128) and keeps its own precision under any other (there is no usable half-precision complex)."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.is_complex():
            return t.to(device=device or t.device, dtype=torch.complex128 if dtype == torch.float64 else t.dtype)
        return t.to(device=device or t.device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    return module._apply(convert)


def state_key(module: nn.Module) -> tuple:
    """What a forward could read besides its input: every parameter's, buffer's and tensor attribute's identity and
    version, and plain scalar attributes, of the module and of modules it keeps as attributes (an HF layer's model).
    Equal keys: an eval forward of the same input computes what it computed before (once determinism holds)."""
    key, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for name, value in vars(m).items():
            if name in BOOKKEEPING:
                continue
            if isinstance(value, nn.Module):
                todo.append(value)
            elif name in ("_parameters", "_buffers"):
                key += [(n, id(t), t._version) for n, t in value.items() if t is not None]
            elif name == "_modules":
                todo += [c for c in value.values() if c is not None]
            elif isinstance(value, (bool, int, float, str, type(None))):
                key.append((name, value))
            elif isinstance(value, (torch.Tensor, list, tuple, dict)):
                key += [(name, id(t), t._version) for t in tensors(value)]
    return tuple(key)


@contextmanager
def kept_modes(module: nn.Module):
    """Every submodule's training flag as it was, after (a frozen BatchNorm in eval inside a training model stays so)."""
    was = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for m, training in was:
            m.training = training


@contextmanager
def train_mode(module: nn.Module, on: bool):
    """Put the module in train (on) or eval mode for a while; restore what each part was."""
    with kept_modes(module):
        module.train(on)
        yield


@contextmanager
def math_attention():
    """scaled_dot_product_attention computed by its reference (math) backend for a while, on every device: a probe
    that judges a block's own arithmetic is not the device's fused kernels' (their fully masked rows give finite
    outputs and, on a CUDA device in half precision, NaN gradients: PyTorch's, not the block's)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3
        with torch.backends.cuda.sdp_kernel(enable_flash=False, enable_math=True, enable_mem_efficient=False):
            yield
        return
    with sdpa_kernel([SDPBackend.MATH]):
        yield


@contextmanager
def _dropouts(module: nn.Module, for_module, for_attribute, configs: bool = False):
    """Dropout probabilities set for a while (modules' p, float attributes named *drop*), put back after; yields how
    many changed. for_module(p) / for_attribute(value): the new value, or None to leave it. configs: also the float
    *drop* fields of a module's `config` object, which Hugging Face layers read at call time (falcon's
    `self.config.hidden_dropout`, persimmon's `self.config.attention_dropout`)."""
    changes = []
    holders = list(module.modules())
    if configs:
        seen = set()
        for m in module.modules():
            c = vars(m).get("config")
            if c is not None and not isinstance(c, nn.Module) and hasattr(c, "__dict__") and id(c) not in seen:
                seen.add(id(c))
                holders.append(c)
    try:
        for m in holders:
            if isinstance(m, nn.modules.dropout._DropoutNd):
                found = [("p", m.p, for_module(m.p))]
            else:
                found = [(k, v, for_attribute(v)) for k, v in list(vars(m).items()) if "drop" in k.lower()]
            for key, old, new in found:
                if new is None:
                    continue
                try:
                    setattr(m, key, new)
                except (AttributeError, TypeError):  # a frozen config (a frozen dataclass): left as it is
                    continue
                changes.append((m, key, old))
        yield len(changes)
    finally:
        for m, key, old in reversed(changes):
            setattr(m, key, old)


def zero_dropout(module: nn.Module):
    """Every dropout probability inside set to 0 for a while (modules, MHA's, float attributes named *drop*, and
    those of a config the modules keep)."""
    return set_dropout(module, 0.0)


def set_dropout(module: nn.Module, rate: float):
    """Every dropout probability inside set to rate for a while, as zero_dropout sets them to 0."""
    return _dropouts(module, lambda p: rate, lambda v: rate if isinstance(v, float) and 0 < v < 1 else None, configs=True)


def raise_dropout(module: nn.Module, p: float = 0.1):
    """Every dropout probability that is 0 set to p for a while (modules, float attributes named *drop*)."""
    return _dropouts(module, lambda q: p if q == 0 else None, lambda v: p if type(v) is float and v == 0.0 else None)


class TorchDropoutOff(TorchFunctionMode):
    """torch's dropout functions as the identity, SDPA and `F.multi_head_attention_forward` with dropout_p 0 (the
    dropout inside MHA is reached through its argument): the randomness torch itself rescales, off. Records the rate
    each was asked for where it would have dropped (`rates`: elementwise, `attention_rates`: SDPA's and MHA's).
    drop_all: torch's elementwise dropouts drop everything instead (a zero tensor out), as at a rate of 1."""

    def __init__(self, drop_all: bool = False):
        super().__init__()
        self.drop_all = drop_all
        self.rates: list[float] = []
        self.attention_rates: list[float] = []
        self.calls: list[float] = []  # both, in the order asked
        self.shapes: list[tuple] = []  # the input shape of each elementwise dropout in rates
        self.attention_calls = 0  # SDPA and MHA calls, dropping or not

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            x = args[0] if args else kwargs["input"]
            p = _argument(args, kwargs, 1, "p", 0.5)
            if p > 0 and _argument(args, kwargs, 2, "training", func not in _ALPHA):
                self.rates.append(float(p))
                self.calls.append(float(p))
                self.shapes.append(tuple(x.shape))
                if self.drop_all and func not in _ALPHA:
                    return x.zero_() if _argument(args, kwargs, 3, "inplace", False) else torch.zeros_like(x)
            return x
        where = _DROPOUT_P.get(func)
        if where is not None:
            self.attention_calls += 1
            p = _argument(args, kwargs, where, "dropout_p", 0.0)
            if p > 0 and (func is not F.multi_head_attention_forward or _argument(args, kwargs, 13, "training", True)):
                self.attention_rates.append(float(p))
                self.calls.append(float(p))
            if len(args) > where:
                args = args[:where] + (0.0,) + args[where + 1:]
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def _argument(args: tuple, kwargs: dict, at: int, name: str, default):
    return args[at] if len(args) > at else kwargs.get(name, default)


_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout})
_ALPHA = frozenset({F.alpha_dropout, F.feature_alpha_dropout})  # training defaults to False; never zeroed
_DROPOUT_P = {F.scaled_dot_product_attention: 4, F.multi_head_attention_forward: 10}  # dropout_p's position


# Added to the seed of Python's and NumPy's streams by `reseed` while checks/seeding.py builds a twin apart from them
STREAMS_APART = [0]


def reseed(seed: int) -> None:
    """torch.manual_seed (and Python's and NumPy's streams), without the lazy seeding of absent accelerators: each of
    CUDA, XPU and MTIA queues a call that formats its caller's traceback (~1 ms a seed, ~27 seeds a battery)."""
    random.seed(seed + STREAMS_APART[0])  # a block may draw from these too (x-transformers' layer dropout)
    if (np := sys.modules.get("numpy")) is not None:
        np.random.seed(seed + STREAMS_APART[0])
    absent = [getattr(torch, name, None) for name in ("cuda", "xpu", "mtia")]
    if any(d is not None and d.is_available() for d in absent):
        torch.manual_seed(seed)
        return
    torch.random.default_generator.manual_seed(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)


@contextmanager
def parameters_replaced(params: dict[str, torch.Tensor], names, fn):
    """Parameters `names` of `params` (name -> parameter) set to fn(name, p) for a while; restored after, even on error."""
    saved = {n: params[n].detach().clone() for n in names if n in params}
    try:
        with torch.no_grad():
            for n in saved:
                params[n].copy_(fn(n, params[n]))
        yield
    finally:
        with torch.no_grad():
            for n, v in saved.items():
                params[n].copy_(v)


@contextmanager
def parameters_swapped(new: dict):
    """Parameter objects put in place of others for a while: {(module, name): parameter}; the originals, untouched
    (their versions too, so no probe computed from them is invalidated), are put back after, even on error."""
    saved = {(m, n): m._parameters[n] for m, n in new}
    try:
        for (m, n), p in new.items():
            m._parameters[n] = p
        yield
    finally:
        for (m, n), p in saved.items():
            m._parameters[n] = p


@contextmanager
def same_draws(device: torch.device, seed: int = 0):
    """torch's random stream (CPU, and the device's) seeded for a while and put back after: two forwards run under it
    draw the same dropout masks, and the caller's own stream is left where it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        reseed(seed)
        yield


def f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy on the CPU, where every comparison is made (MPS has no float64)."""
    return t.detach().to(device="cpu", dtype=torch.float64)


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max|a - ref| / max(1, max|ref|), in float64; inf if either is not finite."""
    a, ref = f64(a), f64(ref)
    if not (torch.isfinite(a).all() and torch.isfinite(ref).all()):
        return float("inf")
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (a - ref).abs().max().item() / scale if a.numel() else 0.0


def changed(t: torch.Tensor, before: torch.Tensor) -> tuple[bool, float]:
    """Whether a tensor handed to a forward was written into, and by how much (rel_diff)."""
    same = torch.equal(t.detach(), before.detach())
    return (not same, 0.0 if same else rel_diff(t, before))


# A block whose output is mostly its input (LayerScale started at 1e-5, a small gain on each branch) shrinks every
# difference of its outputs with its update: a decode that keeps only the prompt's last key measured 4.1e-6 of the
# output behind LayerScale 1e-5, under float32's 1e-5, yet 2.3x what the block adds to its input. Comparisons of
# outputs are also judged against that update (y - x), at the elements where a difference is above their own rounding
# (ROUNDING_ULPS units in the last place of the larger of |y| and |x|; equal computations differ by one at most): above
# UPDATE_SHARE of it, they differ. Where the update is O(1) this share is far above the tolerance and changes nothing.
UPDATE_SHARE = 1e-2
ROUNDING_ULPS = 4


def update_share(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> float:
    """max|got - ref| as a share of the block's update max|ref - x| where it is above ref's rounding; 0 where it is
    not, or where the shapes do not line up (an output that is not the input's shape has no update to compare)."""
    if got.shape != ref.shape or x.shape != ref.shape or not ref.is_floating_point() or not ref.numel():
        return 0.0
    g, r, xx = f64(got), f64(ref), f64(x)  # on the CPU: MPS has no float64
    d = (g - r).abs()
    # each element's own rounding: y = x + f(x) rounds to the larger of the two, a few units in its last place
    above = d > ROUNDING_ULPS * torch.finfo(ref.dtype).eps * torch.maximum(r.abs(), xx.abs())
    update = (r - xx).abs().max().item()
    return d[above].max().item() / update if above.any() and update > 0 else 0.0


def beyond(diff: float, share: float, tol: float) -> bool:
    """Whether outputs differ: by more than the tolerance (rel_diff), or by more than UPDATE_SHARE of the update."""
    return diff > tol or share > UPDATE_SHARE


def grad_of(loss: torch.Tensor, x: torch.Tensor, retain_graph: bool = False, also: list | tuple = ()) -> torch.Tensor | None:
    """d loss / d x (None where x is unused), the gradients of `also` computed beside (for their hooks). A reentrant
    checkpoint inside the block (transformers 4.x's default) refuses `torch.autograd.grad` halfway through the
    backward, so the graph is kept for a plain backward into x.grad, which fills the parameters' .grad too: callers
    keep theirs with `grads_kept`."""
    try:
        return torch.autograd.grad(loss, [x, *also], retain_graph=True, allow_unused=True)[0]
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
    x.grad = None
    loss.backward(retain_graph=retain_graph)
    return x.grad


@contextmanager
def grads_kept(module: nn.Module):
    """The parameters' .grad as they were after the block, whatever backward ran inside (see grad_of): set aside, as a
    backward adds into an existing .grad in place."""
    kept = [(p, p.grad) for p in module.parameters()]
    try:
        for p, _ in kept:
            p.grad = None
        yield
    finally:
        for p, g in kept:
            p.grad = g


def residual_probes(numel: int) -> int:
    """How many probes residual_gain takes for an input of numel elements (see RESIDUAL_ELEMENTS)."""
    return max(1, min(RESIDUAL_PROBES, -(-RESIDUAL_ELEMENTS // max(1, numel))))


def residual_gain(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, gen: torch.Generator,
                  probes: int | None = None) -> float:
    """tr(J)/n of x -> f(x), from Rademacher probes v: E[v . (J^T v)] = tr(J)."""
    probes = probes or residual_probes(x.numel())
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = f(x.clone())
        if out.shape != x.shape:
            raise ValueError(f"output shape {tuple(out.shape)} differs from the input's {tuple(x.shape)}")
        total = 0.0
        for k in range(probes):
            v = (torch.randint(0, 2, out.shape, generator=gen) * 2 - 1).to(device=out.device, dtype=out.dtype)
            # J^T v as the gradient of the dot product: grad_outputs=v would import sympy (~1 s) on first use
            g = grad_of((out * v).sum(), x, retain_graph=k < probes - 1)
            if g is None:
                return 0.0
            total += (f64(v) * f64(g)).sum().item()
        for _ in range(probes, RESIDUAL_PROBES):  # the probes not taken are drawn all the same: the checks after
            torch.randint(0, 2, out.shape, generator=gen)  # this one see the random inputs they always saw
    return total / probes / x.numel()
