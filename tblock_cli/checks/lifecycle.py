"""Checks of a block's life outside one forward: built on the meta device and initialised, saved and loaded into a
fresh instance."""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tblock_cli.checks.context import Context, eval_forward
from tblock_cli.checks.holdings import hidden_params, roots, sibling_shares
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.checks.seeding import built_apart
from tblock_cli.checks.training import all_modules, seeded, too_large
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import cast, module_copy, rel_diff, reseed, train_mode
from tblock_cli.runtime import meta_autocast

# A buffer rebuilt by the block's own init equals the normal build's up to the run dtype's rounding of the same
# computation (ctx.tol); left untouched after to_empty() it holds the NaN tblock wrote there, or garbage.
# Non-floating buffers must be equal.


def named_state(module: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """Every parameter (kind 'params'), buffer ('buffers', persistent or not) or saved tensor ('saved': the
    state_dict's) of the module and its roots, by name (a root after the first prefixed with its class)."""
    out = {}
    for i, root in enumerate(roots(module)):
        prefix = "" if i == 0 else f"<{type(root).__name__}>."
        items = {"params": root.named_parameters, "buffers": root.named_buffers, "saved": root.state_dict}[kind]()
        for n, t in items.items() if kind == "saved" else items:
            out.setdefault(prefix + n, t)
    return out


def _own(m: nn.Module) -> bool:
    """tblock's own wrappers (the HF driver, the built-in block): not the user's state to judge."""
    return type(m).__module__.startswith("tblock_cli")


def own_init(module: nn.Module) -> list[str]:
    """The block's own initialisation, as a deferred-init recipe runs it: every submodule's reset_parameters(); a
    declared init_weights() (a Hugging Face model's runs its family's _init_weights over all of it). What ran."""
    ran = []
    modules = all_modules(module)
    hf = next((m for m in modules if callable(getattr(m, "init_weights", None)) and hasattr(m, "_init_weights")
               and hasattr(m, "config")), None)
    with torch.no_grad():
        if hf is not None:
            hf.init_weights()
            return [f"{type(hf).__name__}.init_weights()"]
        for m in modules:
            for name in ("reset_parameters", "_reset_parameters"):  # nn.MultiheadAttention's is private
                if callable(getattr(m, name, None)):
                    getattr(m, name)()
                    ran.append(f"{name}()")
                    break
        init = getattr(module, "init_weights", None)
        if callable(init) and not _required_args(init):
            init()
            ran.append("init_weights()")
        elif callable(getattr(module, "_init_weights", None)):
            module.apply(module._init_weights)
            ran.append("_init_weights")
    return sorted(set(ran))


def _required_args(fn) -> bool:
    try:
        return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True


def meta_built(rebuild, seed: int) -> nn.Module:
    """rebuild(seed, "meta") without importing torch._dynamo for it. On the meta device a Python number over a tensor
    (`1.0 / base ** (arange(...) / dim)`, every rotary table) runs torch's Python reference, which wraps itself in
    `torch._dynamo.disable` on its first call and so imports dynamo: 1.2-2.3 s measured here, most of a small block's
    battery (the references import sympy too, 0.6 s, for their shape arithmetic: that stays). While the block is
    built, `torch._dynamo` is a stub whose `disable` returns the function itself; after, the stub, what `disable`
    cached on torch's functions and any module first imported meanwhile that kept the stub are gone, so a later
    import (a `--compile`) is the real one. A build that raises under the stub is built again without it (the same
    seed)."""
    if "torch._dynamo" in sys.modules:
        return rebuild(seed, "meta")
    stub, cached = types.ModuleType("torch._dynamo"), []
    stub.disable = lambda fn, recursive=True, wrapping=True: cached.append(fn) or fn
    before = set(sys.modules)
    sys.modules["torch._dynamo"] = stub
    try:
        return rebuild(seed, "meta")
    except Exception:  # noqa: BLE001 - anything the stub lacks: built as torch would, with the real module
        _unstubbed(stub, before, cached)
        reseed(seed)
        return rebuild(seed, "meta")
    finally:
        _unstubbed(stub, before, cached)


def _unstubbed(stub, before: set, cached: list) -> None:
    """The stub out of sys.modules and torch's namespace, the functions' cached `disable` dropped, and every module
    first imported while it stood that holds it dropped too (imported afresh when next asked for)."""
    if sys.modules.get("torch._dynamo") is stub:
        del sys.modules["torch._dynamo"]
    if vars(torch).get("_dynamo") is stub:
        delattr(torch, "_dynamo")
    for fn in cached:
        vars(fn).pop("__dynamo_disable", None)
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        if module is not None and any(v is stub for v in list(vars(module).values())):
            del sys.modules[name]
    cached.clear()


def materialise(module: nn.Module, device: torch.device) -> None:
    """Module.to_empty(device=...), but through torch.empty: empty_like of a meta tensor runs a Python reference that
    imports sympy (1-2 s) on its first call."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _poison(module: nn.Module) -> None:
    """What to_empty() left, made visible: NaN in floating tensors, zeros elsewhere (uninitialised memory is often
    finite, so garbage would pass for values)."""
    with torch.no_grad():
        for m in all_modules(module):
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    t.fill_(float("nan") if t.is_floating_point() else 0)


def _same(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a.cpu(), b.cpu())
    return rel_diff(a, b) <= tol


def check_meta_init(ctx: Context) -> Outcome:
    """Catches: built on the meta device, `to_empty()`, then its own init (`reset_parameters`, a declared
    `init_weights`, the family's `_init_weights` for `hf:`): a buffer that differs from a normal build's (a rotary
    `inv_freq` registered `persistent=False` and computed in `__init__`), or outputs that differ with the normal
    build's weights loaded; skipped where its own init leaves parameters unset (no deferred init to judge) and for a
    module handed over as an instance; an init that assigns new Parameters instead of filling them is a **warning**"""
    if (large := too_large(ctx)) is not None:
        return large
    rebuild = ctx.subject.rebuild
    if rebuild is None:
        return skipped("meta_init.no_factory")
    ctx.step("meta-device build")
    try:
        with seeded(ctx.device, ctx.cfg.seed):
            meta = meta_built(rebuild, ctx.cfg.seed)
            materialise(meta, ctx.device)
            _poison(meta)
            reseed(ctx.cfg.seed)
            before = {n: id(p) for n, p in meta.named_parameters()}
            ran = own_init(meta)
    except Exception as e:  # noqa: BLE001 - the constructor itself does not run on the meta device
        if is_out_of_memory(e):
            raise
        return skipped("meta_init.unbuildable", error=one_line(e))
    # A buffer the init leaves wrong: non-persistent ones are judged (no checkpoint load restores them; a rotary
    # inv_freq computed in __init__); persistent ones a load does restore, so they are a note. Against a fresh normal
    # build: the subject's own buffers may have moved in its forwards (a data-dependent init, running statistics).
    normal = rebuild(ctx.cfg.seed, "cpu").to(ctx.device)
    want, got = named_state(normal, "buffers"), named_state(meta, "buffers")
    saved = named_state(normal, "saved")
    wrong = sorted(n for n, b in want.items() if n in got and not _same(got[n], b, ctx.tol))
    if wrong:  # a buffer drawn at random differs between two normal builds too: only its being set is asked
        other = named_state(rebuild(ctx.cfg.seed + 1, "cpu").to(ctx.device), "buffers")
        wrong = [n for n in wrong if n not in other or _same(other[n], want[n], ctx.tol) or
                 (got[n].is_floating_point() and not torch.isfinite(got[n]).all())]
    persistent = [n for n in wrong if n in saved]
    wrong = [n for n in wrong if n not in saved]
    params = named_state(meta, "params")
    unset = sorted(n for n, p in params.items() if p.is_floating_point() and torch.isnan(p).any())
    if unset:  # no deferred init to judge: its own init does not even set its parameters (a custom norm's weight)
        return skipped("meta_init.incomplete_init", params=unset, buffers=wrong, init=ran)
    # The outputs with the normal build's weights loaded: what a checkpoint load after a meta build gives.
    for src, dst in zip(roots(ctx.subject.module), roots(meta)):
        dst.load_state_dict(src.state_dict(), strict=False)
    x, y = ctx.standard()
    try:
        diff = rel_diff(eval_forward(ctx, x, subject=ctx.subject.like(meta)), y)
    except Exception as e:  # noqa: BLE001 - e.g. a tensor kept outside the buffers, left on the meta device
        if is_out_of_memory(e):
            raise
        return failed("meta_init.forward_raises", None, error=one_line(e), buffers=wrong, init=ran)
    facts = {"buffers": wrong, "checked": len(want), "diff": diff, "limit": ctx.tol, "init": ran,
             "persistent_unset": persistent}
    if wrong:
        return failed("meta_init.buffers", f"{len(wrong)}/{len(want)} buffers", **facts)
    if diff > ctx.tol:
        return failed("meta_init.outputs", diff, **facts)
    # an init that assigns new Parameters (self.weight = nn.Parameter(torch.ones(d))) makes them on the default device,
    # not the one to_empty chose, and leaves a tie, an optimizer or a sharding (fully_shard's DTensors) on the old ones
    replaced = sorted(n for n, p in meta.named_parameters() if n in before and before[n] != id(p))
    if replaced:
        return warned("meta_init.replaced", diff, replaced=replaced, **facts)
    if not want:
        return passed("meta_init.no_buffers", diff, **facts)
    return passed("meta_init.same", diff, **facts)


# ----------------------------------------------------------------------------- state_dict round trip


class _Reads(TorchFunctionMode):
    """Notes every tensor a torch function is handed (by identity) while it is active."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ids.update(id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        return func(*args, **kwargs)


def plain_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors kept as plain attributes (or in lists, tuples, dicts) of the user's modules: neither parameter nor
    buffer, so not moved by .to() and not saved."""
    found = {}
    for m in all_modules(module):
        if _own(m):
            continue
        for k, v in vars(m).items():
            if k.startswith("__"):
                continue
            items = [(k, v)] if isinstance(v, torch.Tensor) else \
                [(f"{k}[{i}]", e) for i, e in enumerate(v)] if isinstance(v, (list, tuple)) else \
                [(f"{k}[{i!r}]", e) for i, e in v.items()] if isinstance(v, dict) and k not in ("_parameters", "_buffers", "_modules") else []
            for name, t in items:
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    found[f"{type(m).__name__}.{name}"] = t
    return found


def check_state_dict(ctx: Context) -> Outcome:
    """Catches: a fresh instance (another seed) loaded with the block's `state_dict` whose outputs differ, missing or
    unexpected keys, parameters hidden in a Python list; a construction no seed reproduces: built twice at one seed of
    torch's, Python's and NumPy's streams, parameters or buffers that differ bit for bit (`torch.seed()` in a
    constructor, the clock, a `torch.empty` weight no init fills); one that draws from Python's or NumPy's stream
    (built again at the same torch seed with those seeded otherwise, it differs: torch.manual_seed alone does not
    reproduce it, and FSDP's ranks seeded by torch build different weights) is a **warning**; a fresh instance that shares trainable parameters with the
    block (a module as a default argument or from a module-level cache: a stack built from it is tied); tensors the
    forward reads that are plain attributes (not moved by `.to()`, not saved) are a **warning**, unless a copy moved
    to the meta device runs its forward there (a cache rebuilt for the input's device)"""
    if (large := too_large(ctx)) is not None:
        return large
    module = ctx.subject.module
    x, y = ctx.standard()
    # Plain tensors the module holds before a forward and that forward reads: state. One it assigns during the call
    # and reads back (a mask built per call) is scratch, and is left alone.
    held = plain_tensors(module)
    reads = _Reads()
    with reads, train_mode(module, False), torch.no_grad():
        ctx.subject(x.clone())
    # a 0-dim tensor (a scale kept as torch.tensor(0.125)) mixes with tensors on any device and of any float dtype
    read_plain = sorted(n for n, t in held.items() if id(t) in reads.ids and t.dim() > 0)
    hidden = hidden_params(module)
    ctx.step("state_dict into a fresh instance")
    if ctx.subject.rebuild is not None:
        fresh, how = ctx.subject.rebuild(ctx.cfg.seed + 1, "cpu").to(ctx.device), "rebuilt"
    else:  # handed over as an instance: a copy whose saved tensors are all overwritten with other values
        fresh, how = module_copy(module), "copy"
        with torch.no_grad():
            for root in roots(fresh):
                for t in root.state_dict(keep_vars=True).values():
                    if t.is_floating_point():
                        t.add_(torch.randn(t.shape, generator=ctx.gen).to(t) * 0.1 + 0.1)
    shared = sibling_shares(module, ctx.subject.sibling, ctx.device) if ctx.subject.sibling is not None else []
    missing, unexpected = [], []
    try:
        for src, dst in zip(roots(module), roots(fresh)):
            result = dst.load_state_dict(src.state_dict(), strict=False)
            missing += result.missing_keys
            unexpected += result.unexpected_keys
    except Exception as e:  # noqa: BLE001 - a size mismatch: strict loading fails outright
        if is_out_of_memory(e):
            raise
        return failed("state_dict.load_fails", None, error=one_line(e), fresh=how)
    diff = rel_diff(eval_forward(ctx, x, subject=ctx.subject.like(fresh)), y)
    apart = built_apart(ctx) if ctx.subject.rebuild is not None else None
    facts = {"fresh": how, "missing": missing, "unexpected": unexpected, "diff": diff, "limit": ctx.tol,
             "plain_tensors": read_plain, "hidden_params": hidden, "shared": shared,
             "built_apart": None if apart is None else apart[1]}
    if apart is not None and apart[0] == "unseeded":
        return failed("state_dict.unseeded", f"{len(apart[1])} apart", **facts)
    if shared:
        return failed("state_dict.shared", f"{len(shared)} shared", **facts)
    if hidden:
        return failed("state_dict.hidden_params", f"{len(hidden)} hidden", **facts)
    if missing or unexpected:
        return failed("state_dict.keys", f"{len(missing)} missing, {len(unexpected)} unexpected", **facts)
    if diff > ctx.tol:
        return failed("state_dict.outputs", diff, **facts)
    if apart is not None:
        return warned("state_dict.other_streams", f"{len(apart[1])} apart", **facts)
    if read_plain and not follows_device(ctx, x):
        return warned("state_dict.plain_tensors", f"{len(read_plain)} plain", **facts)
    return passed("state_dict.round_trip", diff, **facts)


def follows_device(ctx: Context, x: torch.Tensor) -> bool:
    """Whether a copy of the block moved to the meta device (a second device every machine has: shapes only, no
    arithmetic) runs a forward there: the plain tensors it reads are then re-derived or moved with the input (a cache
    rebuilt when the device changes, `self.freqs_cis.to(x.device)`), not left behind as `.to()` leaves them."""
    try:
        copy = cast(module_copy(ctx.subject.module), device=torch.device("meta"))
        with train_mode(copy, False), torch.no_grad(), meta_autocast():
            out = ctx.subject.like(copy)(x.to("meta"))
    except Exception:  # noqa: BLE001 - a tensor left on the old device, or an operator meta lacks: not shown to follow
        return False
    return isinstance(out, torch.Tensor) and out.device.type == "meta"


# ----------------------------------------------------------------------------- history


def _buffers_carried(src: nn.Module, dst: nn.Module) -> None:
    """Every buffer of src's (persistent or not, of whatever shape it has grown to) set on dst: registered state
    is the block's declared state, the same on both sides; only what the module keeps elsewhere differs."""
    mods = dict(dst.named_modules())
    for name, b in src.named_buffers():
        owner, _, leaf = name.rpartition(".")
        m = mods.get(owner)
        if m is not None and leaf in m._buffers and b is not None:
            m._buffers[leaf] = b.detach().clone()


def check_history(ctx: Context) -> Outcome:
    """Catches: a forward whose output depends on the calls before it: the block (after the battery's calls) and a
    fresh instance holding the same parameters and buffers, given the same inputs in another order (a padded batch,
    a shorter and a longer sequence, the standard input), that disagree: a mask or table cached by shape and reused for
    another padding mask, built at the first call's length, state kept outside the module's buffers"""
    if (large := too_large(ctx)) is not None:
        return large
    if ctx.subject.rebuild is None:
        return skipped("history.instance")
    x, _ = ctx.standard()  # the block's own history: at least this forward came first
    B, T = x.shape[0], x.shape[1]
    probes = {"shorter": (x[:, : max(2, T // 2)], None), "longer": (ctx.x(B, 2 * T), None)}
    if ctx.subject.pad_keyword is not None:
        from tblock_cli.checks.mixing import padding_mask

        probes["padded"] = (x, padding_mask(ctx, B, T))
    probes["standard"] = (x, None)
    ctx.step("history: a fresh instance")
    fresh = ctx.subject.rebuild(ctx.cfg.seed, "cpu").to(ctx.device)
    try:
        for src, dst in zip(roots(ctx.subject.module), roots(fresh)):
            dst.load_state_dict(src.state_dict(), strict=False)
            _buffers_carried(src, dst)
    except Exception as e:  # noqa: BLE001 - saved tensors of another size (state_dict's own failure to judge)
        if is_out_of_memory(e):
            raise
        return skipped("history.unloadable", error=one_line(e))
    other = ctx.subject.like(fresh)
    # The block has run at least the standard input (its first call, with --only): it goes padded first, the fresh
    # instance shorter first, so a cache keyed by shape or built at the first call's length differs between the two
    order = {"block": [k for k in ("padded", "longer", "shorter") if k in probes] + ["standard"],
             "fresh": [k for k in ("shorter", "longer", "padded") if k in probes] + ["standard"]}
    outs = {}
    for side, subject in (("block", ctx.subject), ("fresh", other)):
        outs[side] = {}
        for name in order[side]:
            xin, mask = probes[name]
            try:
                outs[side][name] = eval_forward(ctx, xin, mask, subject=subject)
            except Exception as e:  # noqa: BLE001 - a length the block refuses (a maximum): not compared there
                if is_out_of_memory(e):
                    raise
    diffs = {n: rel_diff(outs["block"][n], outs["fresh"][n]) for n in probes if n in outs["block"] and n in outs["fresh"]}
    facts = {"diffs": diffs, "limit": ctx.tol, "order": order}
    if set(diffs) <= {"standard"}:  # the other lengths refused (a maximum) and no padding: no other order ran
        return skipped("history.unrun", **facts)
    worst = max(diffs, key=diffs.get)
    if diffs[worst] > ctx.tol:
        return failed("history.differs", diffs[worst], worst=worst, **facts)
    return passed("history.same", diffs[worst], worst=worst, **facts)
