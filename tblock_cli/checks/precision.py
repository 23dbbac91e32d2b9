"""The mixed-precision check: under autocast and after .to(bfloat16), the outputs stay near float32's; where not,
the first component whose error jumps."""

from __future__ import annotations

import contextlib
import functools
import re

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed, passed, skipped
from tblock_cli.checks.training import all_modules, too_large
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import cast, module_copy, train_mode
from tblock_cli.runtime import dispatch_mode
from tblock_cli.subject.loading import first_tensor

HALF = torch.bfloat16
# Tokens in the probe, batch 1: past 256 a bfloat16 position is no longer exact (8 significant bits: steps of 2 up to
# 512, of 4 beyond), so at 768 tokens 42 % of positions are wrong in a rotary table or angle built from bfloat16
# positions, more than the QUANTILE leaves out; the attention's cost grows with its square.
PRECISION_SEQ = 768
# Each component's output (and the block's) against float32 (autocast), or against float32 computing with the same
# bfloat16-rounded weights and buffers (after .to(bfloat16): the rounding of the weights themselves, an inv_freq
# included, is what .to asks for; the computation's precision is what is judged); per token position, the relative
# error, and of those the QUANTILE. Measured at 768 tokens: correct blocks (zoo, built-in, 89 hf layers, MoE ones whose
# routers send a few tokens elsewhere) 3e-3..8e-3 at d_model 64 and 512, hf funnel 0.045 at 512 (its relative
# positions); rotary positions in bfloat16 (.to) or rotary angles from a matmul autocast runs in bfloat16: 0.36 at
# d_head 16, 0.30 at d_head 64. 0.1 sits 2.2x above the worst correct block and 3x below the bugs.
PRECISION_LIMIT = 0.1
QUANTILE = 0.75
# A selection that rounding flips (a top-k over an untrained block's near-tied keys, x-transformers' attn_sparse_topk)
# moves whole positions, at random places: the positions it leaves alone stay exact (their error ~3e-3, the 10th
# percentile under JUMP_EXACT) and the wrong ones (> the limit) are as frequent in the probe's first third as in its
# last (0.26-0.47 against 0.27-0.43 for three top-k layers). A precision bug of positions or angles leaves the first
# third exact (wrong 0.0-0.8 %, the last 63-88 %); one that degrades every position leaves none exact. Such jumps are
# skipped, not failed: half precision's own error cannot be told from them.
JUMP_EXACT = PRECISION_LIMIT / 10
JUMP_SPREAD = 0.5
# Under autocast some ops compute in bfloat16 and others in float32: code that then writes the one into the other by
# index (an expert's bfloat16 output into a float32 buffer the forward made) raises one of these, on any device, and
# the block cannot train in mixed precision. Judged under autocast only, and only for a write into a tensor the
# forward made: a KV cache the block keeps is filled in its own dtype by inference code (gpt-fast's), which
# autocast is not meant for; after .to(bfloat16) a float32 table the code builds (an ALiBi bias promoting the
# scores) is a block written for float32 weights, as many correct ones are. Kernels this machine lacks for bfloat16
# say "not implemented", and a constant that does not fit bfloat16 says "overflow": neither is judged.
AUTOCAST = "torch.autocast (bfloat16)"
AUTOCAST_STEP = "torch.autocast (bfloat16), in a training step's backward,"
DTYPE_CLASH = re.compile(r"dtypes? (to )?match|same dtype|expected scalar type|expected .*dtype|dtype mismatch|"
                         r"found dtype|expected both|same scalar type", re.I)
KERNEL_GAP = re.compile(r"not implemented|overflow|not supported", re.I)


class HalfRaised(RuntimeError):
    """The autocast run raised: args[0] names the run, args[1] is WriteClashes.first; the original error is its
    __cause__."""


# Writes by index (out[idx] = y, index_add_, scatter_): torch wants the written values in the tensor's own dtype.
INDEX_WRITES = frozenset({"__setitem__", "index_put_", "index_put", "index_add_", "index_add", "index_copy_",
                          "index_copy", "scatter_", "scatter", "scatter_add_", "scatter_add", "masked_scatter_",
                          "masked_scatter"})


class WriteClashes(TorchFunctionMode):
    """Notes the first write by index of one floating dtype into a tensor of another that raised, and whether the
    tensor written is the block's own state (a buffer, parameter or tensor attribute, or a view of one: a KV cache an inference
    codebase fills in its own dtype) or a tensor the forward made (`zeros_like(x)` that experts' outputs fill)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        from tblock_cli.checks.training import all_modules

        self.state = set()
        for m in all_modules(module):
            held = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)) + \
                [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
            self.state.update(_storage(t) for t in held)
        self.first: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:  # the write that raised is noted: a slice write casts, an index write refuses
            if self.first is None and getattr(func, "__name__", "") in INDEX_WRITES and args \
                    and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                dst = args[0]
                src = [a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, torch.Tensor)
                       and a.is_floating_point() and a.dtype != dst.dtype and a.dim() > 0]
                if src:
                    self.first = {"op": func.__name__, "into": str(dst.dtype).replace("torch.", ""),
                                  "values": str(src[0].dtype).replace("torch.", ""), "state": _storage(dst) in self.state}
            raise


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a meta tensor)
        return id(t)


def _float_accumulated(ops: frozenset, func, args: tuple, kwargs: dict):
    """bfloat16 matrix products (ops) computed as float32 products of the same bfloat16 values, rounded once to
    bfloat16: what a bfloat16 GEMM computes where the hardware has one (float32 accumulation, one rounding), at
    float32's speed. Used only on a CPU without bfloat16 matrix instructions, where PyTorch's fallback GEMM runs 8-11x
    slower than float32 (768 tokens, d_model 512: 0.9 s a forward against 0.09 s) for the same values: measured,
    1e-5..1e-4 of the elements differ, by one unit in the last place (summation order). Every other op, and any
    tensor that is not a plain CPU bfloat16 one, runs as it is."""
    if func in ops:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and all(_plain_cpu_half(t) for t in tensors):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(HALF)
    return func(*args, **kwargs)


def _plain_cpu_half(t: torch.Tensor) -> bool:
    return (t.dtype == HALF and t.device.type == "cpu"
            and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)  # a Parameter, not a subclass


def emulates_half_products(device: torch.device) -> bool:
    """True on a CPU whose bfloat16 GEMMs are PyTorch's scalar fallback (no AVX512-BF16 or AMX for oneDNN)."""
    if device.type != "cpu":
        return False
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return True


@contextlib.contextmanager
def _emulated(on: bool):
    """The half runs with bfloat16 matrix products computed as float32 products of the same bfloat16 values, rounded
    once to bfloat16 (_float_accumulated), and nn.MultiheadAttention's fused fast path off: its GEMMs run
    inside one op, out of the mode's reach (the unfused path computes the same attention, with SDPA in bfloat16)."""
    if not on:
        yield
        return
    aten = torch.ops.aten
    products = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default})
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if hasattr(mha, "set_fastpath_enabled") else None
    try:
        if fast is not None:
            mha.set_fastpath_enabled(False)
        with dispatch_mode(functools.partial(_float_accumulated, products)):
            yield
    finally:
        if fast is not None:
            mha.set_fastpath_enabled(fast)


def _half_runs(ctx: Context, module: nn.Module, ref32: nn.Module, ref, ref_parts, x, emulate: bool) -> dict:
    """how -> (the reference's output and component outputs, the bfloat16 run's): under autocast, and after
    `.to(bfloat16)` against float32 computing with the same bfloat16-rounded weights and buffers."""
    ctx.step("autocast")
    witness = WriteClashes(ref32) if emulate else None  # natively, watched only once it has raised (compiled code)
    try:
        with _emulated(emulate), witness or contextlib.nullcontext():
            got, parts = _outputs(ref32, ctx.subject.like(ref32), x, True, ctx.device)
    except Exception as e:  # noqa: BLE001 - which run raised is said
        if is_out_of_memory(e):
            raise
        if witness is None:
            witness = WriteClashes(ref32)
            try:
                with witness:
                    _outputs(ref32, ctx.subject.like(ref32), x, True, ctx.device)
            except Exception as again:  # noqa: BLE001 - the raise is what it is here to see
                if is_out_of_memory(again):
                    raise
        raise HalfRaised(AUTOCAST, witness.first) from e
    results = {"autocast": ([("output", ref)] + ref_parts, [("output", got)] + parts)}
    ctx.step(".to(bfloat16)")
    half = cast(module_copy(module), HALF)
    rounded = module_copy(half).float()  # float32 computing with the bfloat16-rounded weights and buffers
    xh = x.to(HALF)
    ref_r, parts_r = _outputs(rounded, ctx.subject.like(rounded), xh.float(), False, ctx.device)
    with _emulated(emulate):
        got, parts = _outputs(half, ctx.subject.like(half), xh, False, ctx.device)
    results["to_bfloat16"] = ([("output", ref_r)] + parts_r, [("output", got)] + parts)
    return results


def _token_error(got: torch.Tensor, ref: torch.Tensor, seq: int) -> float | None:
    """The 75th percentile over token positions of each position's relative error: a router that sends a few tokens
    to other experts moves a few positions, lost positions or an unscaled softmax move most. None for an output
    with no axis of the probe's length (an expert's own batch of routed tokens) but the last, which holds features (an
    expert's hidden width can equal the probe's length: litgpt's Qwen3-30B-A3B, 768)."""
    rel = _position_errors(got, ref, seq)
    return None if rel is None else _quantile(rel)


def _quantile(rel: torch.Tensor) -> float:
    """The QUANTILE of per-position errors; inf where any is not finite (a non-finite output anywhere shows here)."""
    return torch.quantile(rel.double(), QUANTILE).item() if bool(torch.isfinite(rel).all()) else float("inf")


def _position_errors(got: torch.Tensor, ref: torch.Tensor, seq: int) -> torch.Tensor | None:
    """Each token position's relative error (_token_error's, before its quantile), in position order."""
    axis = next((i for i, n in enumerate(ref.shape[:-1]) if n == seq), None)
    if axis is None or got.shape != ref.shape or not ref.numel():
        return None
    got, ref = got.float(), ref.float()  # errors of 1e-3 and up: float32 measures them, at half float64's cost
    dims = [i for i in range(ref.ndim) if i != axis]
    size = ref.pow(2).sum(dims).sqrt() if dims else ref.abs()
    err = (got - ref).pow(2).sum(dims).sqrt() if dims else (got - ref).abs()
    return err / size.clamp_min(size.mean().item() * 1e-3 + 1e-30)


def _jumps(rel: torch.Tensor) -> dict | None:
    """A component's errors per position (_position_errors) as a selection's jumps (JUMP_EXACT, JUMP_SPREAD): their
    facts, or None."""
    if rel.ndim != 1 or rel.numel() < 3 or not bool(torch.isfinite(rel).all()):
        return None
    third = rel.numel() // 3
    wrong = (rel > PRECISION_LIMIT).double()
    first, last, exact = wrong[:third].mean().item(), wrong[-third:].mean().item(), rel.double().quantile(0.1).item()
    if exact > JUMP_EXACT or not last > 0 or first < JUMP_SPREAD * last:
        return None
    return {"exact": exact, "wrong_first": first, "wrong_last": last}


def _outputs(module: nn.Module, subject, x: torch.Tensor, autocast: bool, device: torch.device):
    """The block's output and every component's first output tensor, in the order the components finished."""
    seen: list[tuple[str, torch.Tensor]] = []
    names = {}
    for m in all_modules(module):
        for n, c in m.named_modules():
            names.setdefault(id(c), f"{type(m).__name__}.{n}" if m is not module and n else n or type(c).__name__)
    for n, c in module.named_modules():
        names[id(c)] = n or type(c).__name__

    def hook(m, _args, out):
        try:
            t = first_tensor(out)
        except TypeError:
            return
        if t.is_floating_point():
            seen.append((names.get(id(m), type(m).__name__), t.detach()))

    hooks = [m.register_forward_hook(hook) for m in all_modules(module) if m is not module]
    try:
        with train_mode(module, False), torch.no_grad(), torch.autocast(device.type, dtype=HALF, enabled=autocast):
            out = subject(x)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def _component_errors(ref: list, got: list, seq: int) -> list[tuple[str, float, torch.Tensor]]:
    """Each component's output error (_token_error), in the order the components finished, with its errors per
    position (name, error, per position); calls matched by name and count (a router's switch may change which experts
    run)."""
    refs: dict[str, list] = {}
    for name, t in ref:
        refs.setdefault(name, []).append(t)
    seen: dict[str, int] = {}
    out = []
    for name, g in got:
        i = seen.get(name, 0)
        seen[name] = i + 1
        r = refs.get(name, [])
        rel = _position_errors(g, r[i], seq) if i < len(r) else None
        if rel is not None:
            out.append((name, _quantile(rel), rel))
    return out


def _autocast_step(ctx: Context, ref32: nn.Module, x: torch.Tensor) -> str | None:
    """One training step of the float32 copy as mixed-precision training runs it: the forward under torch.autocast,
    the backward outside. The error where the backward (or that forward) raises on mixing dtypes (a custom autograd
    Function whose backward meets bfloat16 gradients with float32 tensors: no custom_fwd/custom_bwd); None where the
    step runs, or raises for another reason (a kernel this machine lacks: not the block's)."""
    ctx.step("a training step under autocast")
    try:
        with train_mode(ref32, True), torch.enable_grad():
            with torch.autocast(ctx.device.type, dtype=HALF):
                out = first_tensor(ctx.subject.like(ref32)(x.detach().clone().requires_grad_(True)))
            out.float().sum().backward()
    except Exception as e:  # noqa: BLE001 - only a dtype clash is the block's
        if is_out_of_memory(e):
            raise
        return one_line(e) if DTYPE_CLASH.search(str(e)) and not KERNEL_GAP.search(str(e)) else None
    finally:
        for q in ref32.parameters():
            q.grad = None
    return None


def check_precision(ctx: Context) -> Outcome:
    """Catches: under `torch.autocast` (bfloat16) and after `.to(bfloat16)`, any component's or the output's error
    against float32 at 768 tokens (after `.to`: float32 with the same bfloat16-rounded weights and buffers), the
    75th percentile over positions of each position's relative error, above 0.1; names the first such component
    (rotary positions or angles computed in bfloat16); a block that raises on mixing dtypes under autocast (an
    expert's bfloat16 output written by index into a float32 buffer), in its forward or in a training step's backward
    (a custom autograd Function without custom_fwd/custom_bwd); a float32 input whose output autocast turns bfloat16
    (the residual stream carried in bfloat16 from there on: `(x + y).type_as(y)`); skips an output whose error is
    a selection's jumps (some positions exact, the wrong ones as frequent early as late: a top-k over near-tied keys)"""
    if (large := too_large(ctx)) is not None:
        return large
    if ctx.device.type not in ("cpu", "cuda"):
        return skipped("precision.device", device=ctx.device.type)
    module = ctx.subject.module
    ref32 = module_copy(module).float()
    seq = max(ctx.cfg.seq, PRECISION_SEQ)
    x = torch.randn(1, seq, ctx.cfg.d_model, generator=ctx.gen).to(ctx.device)
    try:
        ref, ref_parts = _outputs(ref32, ctx.subject.like(ref32), x, False, ctx.device)
    except Exception as e:  # noqa: BLE001 - a block with a maximum length: probe at the run's length
        if is_out_of_memory(e):
            raise
        seq = ctx.cfg.seq
        x = x[:, :seq]
        ref, ref_parts = _outputs(ref32, ctx.subject.like(ref32), x, False, ctx.device)
    # emulated where it pays; a block the dispatch mode cannot run (compiled, say) is measured natively, once more
    for emulate in (True, False) if emulates_half_products(ctx.device) else (False,):
        try:
            results = _half_runs(ctx, module, ref32, ref, ref_parts, x, emulate)
            break
        except Exception as e:  # noqa: BLE001 - a block that does not run in bfloat16 at all
            if is_out_of_memory(e):
                raise
            if not emulate:
                cause = e.__cause__ if isinstance(e, HalfRaised) else None
                clash = e.args[1] if isinstance(e, HalfRaised) else None
                if clash is not None and not clash["state"] and DTYPE_CLASH.search(str(cause)) \
                        and not KERNEL_GAP.search(str(cause)):
                    return failed("precision.dtype_clash", how=e.args[0], error=one_line(cause), **clash)
                return skipped("precision.unsupported", error=one_line(cause or e))
    got = results["autocast"][1][0][1]  # the autocast run's output (its first named part: "output")
    if isinstance(got, torch.Tensor) and got.is_floating_point() and got.dtype != ref.dtype:
        return failed("precision.autocast_dtype", got=str(got.dtype).replace("torch.", ""),
                      want=str(ref.dtype).replace("torch.", ""))
    if (clash := _autocast_step(ctx, ref32, x[:, : ctx.cfg.seq])) is not None:
        return failed("precision.dtype_clash", how=AUTOCAST_STEP, error=clash)
    errors, first, worst = {}, {}, {}
    for how, (ref_parts, parts) in results.items():
        comps = _component_errors(ref_parts, parts, seq)
        worst[how] = max(comps, key=lambda c: c[1])
        errors[how] = worst[how][1]
        first[how] = next(((n, e) for n, e, _ in comps if e > PRECISION_LIMIT), (None, 0.0))
    facts = {"errors": errors, "limit": PRECISION_LIMIT, "seq": seq,
             "products": "float32-accumulated" if emulate else "native"}
    how = max(errors, key=errors.get)
    if errors[how] > PRECISION_LIMIT:
        name, _, rel = worst[how]
        if (jumps := _jumps(rel)) is not None:
            return skipped("precision.jumps", how=how, component=name, **jumps, **facts)
        component, err = first[how]
        return failed("precision.differs", errors[how], how=how, component=component, component_error=err, **facts)
    return passed("precision.close", errors[how], **facts)
