"""Provenance: per tensor, the projections whose outputs reach it and the markers it passed (a norm, attention's steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.anatomy.ops import ACTIVATIONS, LINEAR, MULTIPLIES, RELAYOUTS, SCALING, TEMPLATED
from tblock_cli.probes import tensors

# Provenance flags: an activation function acted (gelu, silu, ...), or another nonlinearity did (a
# product of two activations, exp, ...). A projection reached with neither composes linearly.
ACT, NONLINEAR = 1, 2


@dataclass(frozen=True)
class Marker:
    """An entry of a provenance beside the projections' names: what else a tensor came through."""


@dataclass(frozen=True)
class Norm(Marker):
    """The residual stream as a full-width norm left it: provenance starts again."""


@dataclass(frozen=True)
class Product(Marker):
    """The index-th product of two activations: perhaps attention's q.k scores."""

    index: int


@dataclass(frozen=True)
class Probs(Marker):
    """Attention call `call`'s weights (a softmax over a product), before they meet the values."""

    call: int


@dataclass(frozen=True)
class Attn(Marker):
    """Attention call `call`'s output."""

    call: int


@dataclass(frozen=True)
class Stream(Marker):
    """The block's input as it came: the residual stream no norm has read since (a norm's output starts again)."""


NORM = Norm()
STREAM = Stream()
Prov = dict  # str (a projection) | Marker -> ACT | NONLINEAR flags since it


def owns_several_matrices(m: nn.Module) -> bool:
    """nn.MultiheadAttention, or a module holding bare weight matrices: each matrix is a projection of its own."""
    return isinstance(m, nn.MultiheadAttention) or sum(p.ndim >= 2 for p in m.parameters(recurse=False)) > 1


def qualified(module_name: str, param_name: str) -> str:
    return f"{module_name}.{param_name}" if module_name else param_name


def row_range(src: torch.Tensor, out: torch.Tensor) -> tuple[int, int] | None:
    """(r0, r1) where out is rows r0..r1 of the 2-D matrix src (a view sharing its storage and strides), else None."""
    if src.ndim != 2 or out.ndim != 2 or out.shape[1] != src.shape[1] or out.stride() != src.stride() or not src.stride(0):
        return None
    if out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
        return None
    offset = out.storage_offset() - src.storage_offset()
    if offset < 0 or offset % src.stride(0) or out.shape[0] == 0:
        return None
    r0 = offset // src.stride(0)
    return (r0, r0 + out.shape[0]) if r0 + out.shape[0] <= src.shape[0] else None


class Provenance:
    """Follows provenance through the torch calls of one forward: which projections (weight matrices, named by their
    module) each tensor comes from, what each projection reads, which norms restart the stream."""

    def __init__(self, module: nn.Module):
        self.owner: dict[int, str] = {}  # id(weight matrix) -> module name
        self.params: set[int] = set()
        # every traced tensor stays alive, so ids are not reused; the module's own too: a buffer the forward replaces
        # (self.cache = self.cache.to(q)) would otherwise free its id for an activation, which would then read as a constant
        self.keep: list = []
        for name, m in module.named_modules():
            per_matrix = owns_several_matrices(m)
            for pn, p in m.named_parameters(recurse=False):
                self.params.add(id(p))
                self.keep.append(p)
                if p.ndim >= 2 and id(p) not in self.owner:
                    self.owner[id(p)] = qualified(name, pn) if per_matrix else name
            for b in m.buffers(recurse=False):
                self.params.add(id(b))
                self.keep.append(b)
        self.slices: dict[str, set[tuple[int, int]]] = {}  # weight -> row ranges used as projections of their own
        # a weight concatenated on the fly from others (F.linear(x, torch.cat([wq, wkv]))) -> (owner, rows) of each
        self.fused: dict[str, tuple[tuple[str, int], ...]] = {}
        self.of: dict[int, Prov] = {}  # id(tensor) -> its provenance
        self.scalar: dict[int, float] = {}  # id(tensor) -> product of scalar factors applied to it by scaling ops
        self.linear_in: dict[str, Prov] = {}  # projection -> provenance of its input
        self.proj_outs: set[int] = set()  # ids of projection outputs
        self.stream_norms = False
        self.ffn_middles: set[str] = set()  # FFN projections that both consume one and are consumed (a nested FFN's)
        self.split_streams: list[str] = []  # MHA calls whose query is normalised but whose key or value is not
        self.products: dict[int, tuple[str, str]] = {}  # id(a * b) of two projections' outputs -> their names
        self.act_after_product: list[tuple[str, ...]] = []  # projections multiplied together before an activation
        self.normed_outputs: set[str | Marker] = set()  # projections (and calls' Attn) whose output a full-width norm reads
        # tensors whose values depend on the block's input, and the projections seen reading one or only others: a
        # projection that never reads one reads a constant (a learned cross-attention context, a timestep's embedding)
        self.live: set[int] = set()
        self.reads_input: set[str] = set()
        self.reads_other: set[str] = set()

    def watch(self, t) -> None:
        """t depends on the block's input (the input itself, or a tensor computed from it); a view's base holds it too
        (buf[:, :n].add_(x) writes buf)."""
        for o in tensors(t):
            for u in (o, o._base):
                if u is not None:
                    self.keep.append(u)
                    self.live.add(id(u))

    def is_live(self, t) -> bool:
        """A tensor that depends on the block's input, or a view of one (a view taken before its base was written)."""
        return isinstance(t, torch.Tensor) and (id(t) in self.live or (t._base is not None and id(t._base) in self.live))

    def reads_constant(self, proj: str) -> bool:
        """Whether projection proj was seen reading only tensors that do not depend on the block's input (a projection
        recorded otherwise, as nn.MultiheadAttention's, is not). Where no projection read the input at all, the input
        was not followed (a model that copies it outside torch's calls): none is."""
        return bool(self.reads_input) and proj in self.reads_other and proj not in self.reads_input

    def get(self, t) -> Prov:
        return self.of.get(id(t), {}) if isinstance(t, torch.Tensor) else {}

    def put(self, t, prov: Prov) -> None:
        for o in tensors(t):
            self.keep.append(o)
            self.of[id(o)] = dict(prov)

    @staticmethod
    def union(provs, flag: int = 0) -> Prov:
        out: Prov = {}
        for p in provs:
            for k, v in p.items():
                out[k] = out.get(k, 0) | v | (flag if not isinstance(k, Marker) else 0)
        return out

    def flow(self, acts, out, flag: int = 0) -> None:
        """out comes from acts, through an op with that flag."""
        self.put(out, self.union((self.get(t) for t in acts), flag))

    def sources(self, t) -> tuple[str, ...]:
        return tuple(sorted(k for k in self.get(t) if not isinstance(k, Marker)))

    def is_param(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.params

    def follow_weight(self, args, out, sliced: bool = False) -> bool:
        """A view or cast of a weight matrix (W.t(), W.T, W.to(dtype)) is that weight: same owner. So is one expert's
        slice of a 3-D experts weight (W[e], W[expert_ids]): mixture-of-experts layers keep the experts stacked. A
        range of a 2-D weight's rows (W[:3 * d], W[3 * d:]: modded-nanogpt's one qkvo matrix) is a projection of its
        own, named `owner[r0:r1]`; so is each part of a split or chunk of one (W.chunk(4): four projections)."""
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if sliced and isinstance(out, (tuple, list)):
            return any([self.follow_weight(args, o, sliced=True) for o in out])  # every part followed, not the first
        if src is None or id(src) not in self.owner or not isinstance(out, torch.Tensor):
            return False
        if out.numel() != src.numel() and not (sliced and src.ndim == 3):
            rows = row_range(src, out) if sliced else None
            if rows is None or "[" in self.owner[id(src)]:
                return False
            name = f"{self.owner[id(src)]}[{rows[0]}:{rows[1]}]"
            self.slices.setdefault(self.owner[id(src)], set()).add(rows)
            self.owner[id(out)] = name
            self.params.add(id(out))
            self.keep.append(out)
            return True
        self.owner[id(out)] = self.owner[id(src)]
        self.params.add(id(out))
        self.keep.append(out)
        return True

    def cat_weights(self, args, kwargs, out) -> bool:
        """torch.cat of weight matrices along their rows (each a projection's, the same width): one weight whose
        projection is each of theirs (F.linear(x, torch.cat([wq, wkv])) projects by wq and by wkv), named a+b."""
        parts = args[0] if args and isinstance(args[0], (list, tuple)) else None
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if not parts or len(parts) < 2 or dim not in (0, -2) or not isinstance(out, torch.Tensor) or out.ndim != 2:
            return False
        if not all(isinstance(t, torch.Tensor) and t.ndim == 2 and id(t) in self.owner and t.shape[1] == out.shape[1]
                   for t in parts):
            return False
        names = [self.owner[id(t)] for t in parts]
        if any(n in self.fused for n in names) or len(set(names)) != len(names):
            return False
        name = "+".join(names)
        self.fused[name] = tuple((n, t.shape[0]) for n, t in zip(names, parts))
        self.owner[id(out)] = name
        self.params.add(id(out))
        self.keep.append(out)
        return True

    def scaled_weight(self, args, out) -> bool:
        """A weight matrix times (or over) a scalar (a learned one: modded-nanogpt's `lam * W`) is that weight."""
        ws = [a for a in args if isinstance(a, torch.Tensor) and id(a) in self.owner]
        if len(ws) != 1 or not isinstance(out, torch.Tensor) or out.shape != ws[0].shape:
            return False
        others = [a for a in args if a is not ws[0]]
        if not all(isinstance(a, (int, float)) or (isinstance(a, torch.Tensor) and a.numel() == 1 and not self.is_live(a))
                   for a in others):
            return False
        return self.follow_weight((ws[0],), out)

    def reads(self, proj: str, acts, weight) -> None:
        """Projection proj reads acts: what they came from is its input's provenance. A read of constants only (learned
        memory slots through the key projection) does not replace what a read of the input found."""
        live = any(self.is_live(t) for t in acts if t is not weight)
        if live or proj not in self.reads_input:
            self.linear_in[proj] = self.union(self.get(t) for t in acts if t is not weight)
        (self.reads_input if live else self.reads_other).add(proj)

    def projection(self, proj: str, out) -> None:
        """out is projection proj's output: a provenance of its own."""
        self.put(out, {proj: 0})
        self.proj_outs.add(id(out))

    def norm(self, acts, out, stream: bool) -> None:
        """A norm function's output: a norm of the residual stream starts provenance again; a per-head (QK) norm
        keeps q as q."""
        if stream and not (len(acts) == 1 and self.one_projection(acts[0])):
            self.put(out, {NORM: 0})
            self.stream_norms = True
        else:
            self.flow(acts, out, NONLINEAR)

    def one_projection(self, t) -> bool:
        """t is one projection's output, or a view of it (a head split: q.view(B, T, H, dh).transpose(1, 2)): a norm
        of it at the stream's width (a per-head norm whose head is d_model wide, OLMo-2's full-width q_norm) is that
        projection's, not a norm of the stream."""
        return id(t) in self.proj_outs

    def norm_out(self, args: tuple, out) -> None:
        """A norm module's output: a new start of the residual stream, unless it normalises one projection's output
        (olmo2's full-width q_norm) or an attention output (bitnet's attn_sub_norm): then it stays what it read. A norm
        called with the residual too (Gemma's norm fused with the add: norm(a, x)) normalises the stream."""
        inp = args[0] if len([a for a in args if isinstance(a, torch.Tensor)]) == 1 else None
        if isinstance(inp, torch.Tensor) and (self.one_projection(inp) or any(isinstance(k, Attn) for k in self.get(inp))):
            self.normed_outputs.update(self.get(inp))  # a sublayer's output normalised before the add (OLMo-2)
            self.put(out, self.union([self.get(inp)], NONLINEAR))
        else:
            self.put(out, {NORM: 0})

    def op(self, name: str, args, acts, out) -> None:
        """Any other torch call: an activation, a scaling, a linear op (a view, an add), or a nonlinearity."""
        if name in TEMPLATED:  # x.to(q): x's data in q's dtype, nothing of q's values
            acts = [t for t in acts if args and t is args[0]]
        if name in ACTIVATIONS:
            pair = self.products.get(id(acts[0])) if acts else None
            if pair is not None:
                self.act_after_product.append(pair)
            self.flow(acts, out, ACT)
        elif name in SCALING:
            with_prov = [t for t in acts if self.get(t) or t.numel() > 1]
            flag = NONLINEAR if len([t for t in acts if self.get(t)]) >= 2 else 0
            self.note_product(acts, out)
            self.flow(with_prov, out, flag)
            self.track_scalar(name, args, out)
            self.carry_scalar(name, args, acts, out)
        elif name in LINEAR:
            self.flow(acts, out)
            if len(acts) == 1 and isinstance(out, (tuple, list)) and id(acts[0]) in self.scalar:
                for o in tensors(out):  # q.chunk(2, -1) of a scaled q (rotate-half): each part keeps its factor
                    self.scalar[id(o)] = self.scalar[id(acts[0])]
            if len(acts) == 1 and isinstance(out, torch.Tensor):  # a view or copy keeps the scalar factor
                self.scalar[id(out)] = self.scalar.get(id(acts[0]), 1.0)
                if name in RELAYOUTS and id(acts[0]) in self.proj_outs:  # and a projection's output stays one
                    self.proj_outs.add(id(out))
            elif name in RELAYOUTS and id(acts[0] if acts else None) in self.proj_outs:
                self.proj_outs.update(id(o) for o in tensors(out))  # q.chunk(H, -1), q.unbind(2): each part
            else:
                self.carry_scalar(name, args, acts, out)
        else:
            self.flow(acts, out, NONLINEAR)

    def write(self, dst, sources, out) -> None:
        """Data written into dst (in place, or into the copy `out` an out-of-place index_put returns): it holds what it
        held and what was written, linearly. A buffer written with activations (a KV cache) holds activations from then
        on, and a view written in place writes its base too (cache[:B][:, pos] = k fills cache)."""
        prov = self.union([self.get(dst)] + [self.get(t) for t in sources])
        targets = [dst, dst._base] if dst._base is not None else [dst]
        if isinstance(out, torch.Tensor) and out is not dst:
            targets = [out]
        for t in targets:
            self.params.discard(id(t))  # no longer a constant of the module's: it holds what flowed in
            self.put(t, self.union([self.get(t), prov]))

    def note_product(self, acts, out) -> None:
        """a * b of two different projections' outputs, neither through an activation yet (a gated FFN's product)."""
        direct = [self.get(t) for t in acts[:2]]
        if len(acts) < 2 or not isinstance(out, torch.Tensor) or not all(len(p) == 1 for p in direct):
            return
        (a, fa), (b, fb) = (next(iter(p.items())) for p in direct)
        if a != b and not isinstance(a, Marker) and not isinstance(b, Marker) and a in self.linear_in \
                and b in self.linear_in and not (fa | fb):
            self.products[id(out)] = (a, b)

    def track_scalar(self, name: str, args, out) -> None:
        """x * c or x / c with a number c: remember the factor, so a q scaled before the product counts as scaled."""
        if not isinstance(out, torch.Tensor) or len(args) != 2 or name.startswith("__r"):
            return
        x, c = args
        if isinstance(c, torch.Tensor) and c.numel() == 1 and not self.get(c):
            c = c.item()
        if not isinstance(x, torch.Tensor) or not isinstance(c, (int, float)) or c == 0:
            return
        self.scalar[id(out)] = self.scalar.get(id(x), 1.0) * (c if name.startswith(("mul", "__mul", "__imul")) else 1 / c)

    def carry_scalar(self, name: str, args, acts, out) -> None:
        """A scalar factor kept through an op linear in the activations it reads: an activation times (or over) a
        constant table (a rotary cos/sin, a mask) or a learned gain, and sums, differences, concatenations of
        activations that all carry the same factor (`t1 * cos - t2 * sin` of a q scaled before its rotation). A
        constant added, factors that differ, or an activation in a divisor: none."""
        if not isinstance(out, torch.Tensor) or id(out) in self.scalar:
            return
        moving = [t for t in acts if self.get(t)]
        if not moving:
            return
        if name in SCALING:
            if len(moving) != 1 or (name not in MULTIPLIES and moving[0] is not args[0]):
                return
        elif len(moving) != len(acts):
            return
        factors = {self.scalar.get(id(t), 1.0) for t in moving}
        if len(factors) == 1 and (f := factors.pop()) != 1.0:
            self.scalar[id(out)] = f

    def folded(self, q, k) -> float:
        """|the scalar factors applied to q and k on their way to the product|."""
        return abs(self.scalar.get(id(q), 1.0) * self.scalar.get(id(k), 1.0))
