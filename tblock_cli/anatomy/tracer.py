"""The tracer: one TorchFunctionMode that hands each torch call of a forward to its recorders (provenance, attention
calls, FLOPs), and counts the calls they slipped on."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tblock_cli.anatomy.calls import AttentionRecorder
from tblock_cli.anatomy.counts import Counts
from tblock_cli.anatomy.ops import CATS, LINEAR, MATMULS, MULTIPLIES, NORMS, SCALING, SLICES, SOFTMAX, TEMPLATED, WRITES
from tblock_cli.anatomy.provenance import Provenance, tensors

# Products that project by a weight matrix when one operand is a module's weight (or a view of it).
WEIGHT_PRODUCTS = {"addmm", "matmul", "mm", "__matmul__", "bmm", "grouped_mm", "_grouped_mm"}
# The first few slips' errors kept as facts (one is usually all there is; more repeat it).
MAX_SLIP_ERRORS = 3
# Half-precision dtypes a call may narrow a float32 or float64 activation to (see `narrowed`).
HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_NARROWED = 3


class Tracer(TorchFunctionMode):
    """Follows one forward: `prov` (where each tensor comes from), `attn` (the attention calls), `counts` (FLOPs and
    shapes per projection). Module hooks keep `module_stack` (the module running now) and call `leave`."""

    def __init__(self, module: nn.Module, d_model: int, capture: bool = False):
        super().__init__()
        self.d_model = d_model
        self.module_stack: list[str] = [""]
        self.prov = Provenance(module)
        self.counts = Counts()
        self.attn = AttentionRecorder(self.prov, self.counts, self.module_stack, capture)
        # torch calls the recorder raised on (the user's forward went on): an anatomy that lost one may lack an
        # attention call or a role, so the count is a fact the checks report, with the first few errors
        self.slips = 0
        self.slip_errors: list[str] = []
        # calls whose output is in half precision while an input reading the block's input was wider (an explicit
        # .half() of the scores, an autocast the forward enters): (module, call, from dtype, to dtype), the first few
        self.narrowed: list[tuple[str, str, str, str]] = []

    def leave(self, name: str, out) -> None:
        if len(self.module_stack) > 1:
            self.module_stack.pop()
        if isinstance(out, torch.Tensor):  # the module's output shape, as torchinfo shows it
            self.counts.out_shape[name] = tuple(out.shape)

    # ---------------------------------------------------------------- the hook
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        # x.to(q), x.type_as(q), x.expand_as(q): x's values, q's dtype or shape only
        read = args[:1] if name in TEMPLATED else (args, kwargs)
        if self.prov.live and any(self.prov.is_live(t) for t in tensors(read)):
            if name in WRITES and args and isinstance(args[0], torch.Tensor):
                self.prov.watch(args[0])  # and its base, as watch does for any view
            if isinstance(out, torch.Tensor) and out.dtype in HALF_DTYPES and len(self.narrowed) < MAX_NARROWED:
                self.note_narrowing(name, read, out)
            self.prov.watch(out)
        if name == "__get__" and isinstance(out, torch.Tensor):
            self.prov.follow_weight(args, out)  # W.T, W.mT: still the module's weight
            return out
        if name in WRITES and args and isinstance(args[0], torch.Tensor):
            self.guarded(self.write, name, args, kwargs, out)  # cache[:, pos] = k returns None: caught before that test
            return out
        if name in ("__get__", "__set__") or not any(True for _ in tensors(out)):
            return out
        if name in LINEAR and self.prov.follow_weight(args, out, sliced=name in SLICES):
            return out
        if name in CATS and self.prov.cat_weights(args, kwargs, out):
            return out
        # lam * W: W scaled by a learned scalar (W / c too; c / W is no weight)
        if name in SCALING and (name in MULTIPLIES or id(args[0]) in self.prov.owner) and self.prov.scaled_weight(args, out):
            return out
        self.guarded(lambda *a: self.record(func, *a), name, args, kwargs, out)
        return out

    def note_narrowing(self, name: str, read, out: torch.Tensor) -> None:
        wide = next((t for t in tensors(read) if self.prov.is_live(t) and t.is_floating_point()
                     and t.dtype.itemsize > out.dtype.itemsize), None)
        if wide is not None:
            self.narrowed.append((self.module_stack[-1] or "(root)", name, str(wide.dtype).removeprefix("torch."),
                                  str(out.dtype).removeprefix("torch.")))

    def guarded(self, recorder, name, args, kwargs, out) -> None:
        try:
            recorder(name, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - a tracing slip must never break the user's forward: it is counted
            self.slips += 1
            if len(self.slip_errors) < MAX_SLIP_ERRORS:
                self.slip_errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])

    def write(self, name, args, kwargs, out) -> None:
        """A write of data into a tensor (cache[:, pos] = k, copy_, index_copy_, index_put_): the data written flows
        into it; integer and bool index tensors only say where."""
        data = [t for t in tensors((args[1:], kwargs)) if t.is_floating_point() or t.is_complex()]
        self.prov.write(args[0], data, out)

    def record(self, func, name, args, kwargs, out):
        """One torch call, handed to the recorder it concerns."""
        ins = [t for t in tensors((args, kwargs))]
        acts = [t for t in ins if not self.prov.is_param(t)]
        if func is F.linear or (name in WEIGHT_PRODUCTS and any(id(t) in self.prov.owner for t in ins)):
            self.projection(func, name, args, kwargs, ins, acts, out)
        elif func is F.multi_head_attention_forward:
            self.attn.mha(args, kwargs, out)
        elif func is F.scaled_dot_product_attention:
            self.attn.sdpa(args, kwargs, out)
        elif name in NORMS and func is getattr(F, name, None):
            # a norm of the residual stream is a new start for provenance; a per-head (QK) norm keeps q as q
            self.prov.norm(acts, out, stream=out.shape[-1] == self.d_model)
        elif name in SOFTMAX:
            self.attn.softmax(args, kwargs, out, ins)
        elif name == "baddbmm" and baddbmm_operands(args, kwargs) is not None:
            b1, b2, alpha = baddbmm_operands(args, kwargs)  # input + alpha * b1 @ b2: the q.k part is b1 @ b2 alone
            self.attn.matmul(b1, b2, out, product=(b1.detach() @ b2.detach()) * alpha)
        elif name in MATMULS and len(acts) >= 2 and (any(self.prov.is_live(t) for t in acts[:2]) or not self.prov.reads_input):
            # a product that reads the input's tokens on one side at least (positions times frequencies, a rotary
            # table's outer product of constants, is no attention: torchscale's XPos)
            self.attn.matmul(acts[0], acts[1], out)
        else:
            self.prov.op(name, args, acts, out)

    def projection(self, func, name, args, kwargs, ins, acts, out) -> None:
        """x projected by a module's weight matrix: what it reads (provenance), its FLOPs and shape, and (capturing)
        whether its input rows were equal."""
        weight = kwargs.get("weight", args[1] if func is F.linear and len(args) > 1 else None)
        if weight is None:
            weight = next(t for t in ins if id(t) in self.prov.owner)
        proj = self.prov.owner.get(id(weight))
        x = args[0] if func is F.linear or name != "addmm" else args[1]
        if proj is None:
            self.prov.flow(acts, out)
            return
        fan_in = weight.shape[-1] if func is F.linear else weight.shape[-2]
        if proj in self.prov.fused:  # one product by weights concatenated on the fly: a projection by each of them
            parts = self.prov.fused[proj]
            for part, rows in parts:
                self.prov.reads(part, acts, weight)
                self.attn.projection_input(part, x)
                self.counts.add(part, 2 * rows * fan_in * (x.numel() // max(1, fan_in)), (*out.shape[:-1], rows))
            self.prov.put(out, {part: 0 for part, _ in parts})
            self.prov.proj_outs.add(id(out))
            return
        self.prov.reads(proj, acts, weight)
        self.attn.projection_input(proj, x)
        self.counts.projection(proj, weight, x, out, fan_in)
        self.prov.projection(proj, out)


def baddbmm_operands(args, kwargs):
    """(batch1, batch2, alpha) of a baddbmm(input, batch1, batch2, beta=, alpha=) call, given by position or keyword."""
    b1 = kwargs.get("batch1", args[1] if len(args) > 1 else None)
    b2 = kwargs.get("batch2", args[2] if len(args) > 2 else None)
    alpha = kwargs.get("alpha", 1)
    if not (isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor) and isinstance(alpha, (int, float))):
        return None
    return b1, b2, alpha
