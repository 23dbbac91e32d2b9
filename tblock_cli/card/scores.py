"""The attention calls of one forward as the spec readers need them: per call the q and k that enter the q.k product
(laid out (B, H, L, E)), the scores as softmax reads them, and where in the forward the product was taken, so that a
later forward of the same input can scale that call's q operand alone (0: the scores are the additive bias and mask;
small: the linear part, whose slope is the score scale; large: whatever bounds the logits)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tblock_cli.anatomy.attention import sdpa_signature
from tblock_cli.anatomy.mha import MASKED_LOGIT, MHACall
from tblock_cli.anatomy.provenance import Product
from tblock_cli.anatomy.tracer import Tracer
from tblock_cli.card.probe import Probe
from tblock_cli.probes import train_mode


@dataclass(frozen=True)
class Scores:
    """One attention call of a forward."""

    kind: str  # sdpa | softmax | weights (softmax written out: its logits are log-weights) | mha
    where: str  # the module it ran in
    ordinal: int  # the index of its q.k product among the forward's torch calls (-1: not reachable, mha)
    q: torch.Tensor  # (B, H, L, E) as it enters the product (float64; the live tensor when captured with grad)
    k: torch.Tensor  # (B, Hk, S, E): Hk < H where grouped keys enter the product unrepeated (sdpa's enable_gqa)
    fold: float  # scalar factors applied to q and k on their way to the product (q * 0.125): undone to read a scale
    logits: torch.Tensor  # (B, H, L, S) float64, -inf where masked
    sources: tuple[str, ...] = ()  # the projections whose outputs reach q
    v: torch.Tensor | None = None  # (B, Hv, S, E) float64 as it enters sdpa; None where not read (a softmax written out)
    k_sources: tuple[str, ...] = ()  # the projections whose outputs reach k

    @property
    def square(self) -> bool:
        return self.logits.shape[-1] == self.logits.shape[-2]

    @property
    def valid(self) -> torch.Tensor:
        return torch.isfinite(self.logits) & (self.logits > MASKED_LOGIT)

    def product(self) -> torch.Tensor:
        """q.k per head (B, H, L, S) with the folded factors undone: what a score scale multiplies."""
        q, k = self.q.detach().double(), self.k.detach().double()
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        return (q @ k.transpose(-2, -1)) / self.fold


def _heads(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """t as (B, H, N, E) with B and H of the scores `like` (B, H, L, S); None where it cannot be laid out so."""
    if t.ndim == 4:
        return t
    B, H = like.shape[0], like.shape[1] if like.ndim == 4 else 1
    if t.numel() % (B * H * t.shape[-1] * t.shape[-2]) or t.numel() != B * H * t.shape[-2] * t.shape[-1]:
        return None
    return t.reshape(B, H, t.shape[-2], t.shape[-1])


def _without_sinks(logits: torch.Tensor, S: int) -> torch.Tensor:
    """The S key columns of scores with learned sink logits beside them: x-transformers prepends its sinks (a column
    equal down every query where the last key's is not), gpt-oss appends them (and subtracts each row's maximum, so
    neither end is constant): the end unless only the start is constant."""
    n = logits.shape[-1] - S

    def constant(cols: torch.Tensor) -> bool:
        ok = torch.isfinite(cols).all()
        return bool(ok and (cols - cols[..., :1, :]).abs().max() <= 1e-12 * cols.abs().max().clamp_min(1))

    start_only = constant(logits[..., :n]) and not constant(logits[..., S:])
    return logits[..., n:] if start_only else logits[..., :S]


def _einsum_qk(eq: str, a: torch.Tensor, b: torch.Tensor):
    """q (..., L, E) and k (..., S, E) from an einsum's two operands, laid out as its output (..., L, S)."""
    ins, out = eq.replace(" ", "").split("->")
    la, lb = ins.split(",")
    shared = [c for c in la if c in lb and c not in out]
    if len(shared) != 1 or len(out) < 2:
        return None
    c = shared[0]
    qa = torch.einsum(f"{la}->{out[:-1]}{c}", a) if set(out[:-1]) <= set(la) else None
    kb = torch.einsum(f"{lb}->{out[:-2]}{out[-1]}{c}", b) if set(out[:-2] + out[-1]) <= set(lb) else None
    return (qa, kb) if qa is not None and kb is not None else None


def _operands(name: str, args: tuple, kwargs: dict):
    """(where the q operand sits: an index into args or a keyword, q, k as (..., S, E), the two operands as passed) of a
    product call (the operands carry the tracer's scalar factors: q * 0.125 before the product); None where
    it is not a product of two operands (baddbmm's added input is not one: bloom's alibi.baddbmm(batch1=q, batch2=k))."""
    if name == "einsum" and args and isinstance(args[0], str):
        ops = args[1:] if len(args) > 2 else tuple(args[1])
        if len(ops) != 2:
            return None
        got = _einsum_qk(args[0], ops[0], ops[1])
        return (1 if len(args) > 2 else None, *got, ops[0], ops[1]) if got else None
    if name == "baddbmm":
        named = [("batch1", 1), ("batch2", 2)]
        where = [k if k in kwargs else i for k, i in named]
        a, b = [kwargs[w] if isinstance(w, str) else (args[w] if len(args) > w else None) for w in where]
    else:
        where = [0, 1]
        a, b = (args[0], args[1]) if len(args) >= 2 else (None, None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.ndim < 2 or b.ndim < 2 \
            or a.shape[-1] != b.shape[-2]:
        return None
    return where[0], a, b.transpose(-2, -1), a, b


class ScoreTracer(Tracer):
    """The dataflow tracer, remembering each attention call's q.k product (its operands and where it was taken), and
    scaling the q operand of chosen products by `factor` (a later forward of the same input)."""

    def __init__(self, module, d_model: int, targets: frozenset[int] = frozenset(), factor: float = 1.0):
        super().__init__(module, d_model, capture=True)
        self.targets, self.factor = targets, factor
        self.n = -1  # ordinal of the call being handled
        self.products_at: dict[Product, tuple] = {}  # score marker -> (ordinal, q, k, fold, sources of q)
        self.calls: dict[int, tuple] = {}  # attention index -> (kind, ordinal, q, k, fold, sources of q)
        self.k_sources: dict[int, tuple] = {}  # ordinal of a product -> the projections whose outputs reach its k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.n += 1
        if self.n in self.targets:
            args, kwargs = self.scaled(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def scaled(self, func, args, kwargs):
        """args with the q operand times factor (its provenance kept, so the tracer still follows it)."""
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            if "query" in kwargs:
                q = kwargs["query"]
                kwargs = {**kwargs, "query": self.follow(q, q * self.factor)}
            else:
                args = (self.follow(args[0], args[0] * self.factor), *args[1:])
            return args, kwargs
        got = _operands(name, args, kwargs)
        if got is None or got[0] is None:
            return args, kwargs
        at = got[0]
        if isinstance(at, str):
            return args, {**kwargs, at: self.follow(kwargs[at], kwargs[at] * self.factor)}
        return tuple(self.follow(a, a * self.factor) if j == at else a for j, a in enumerate(args)), kwargs

    def follow(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        self.prov.put(new, self.prov.get(old))
        return new

    def fold(self, q, k) -> float:
        return self.prov.folded(q, k) or 1.0

    def record(self, func, name, args, kwargs, out):
        attn = self.attn
        before = len(attn.calls)
        if func is F.scaled_dot_product_attention:
            bound = inspect.signature(sdpa_signature).bind(*args, **kwargs)
            q, k, v = bound.arguments["query"], bound.arguments["key"], bound.arguments["value"]
            super().record(func, name, args, kwargs, out)
            if len(attn.calls) > before:
                self.calls[before] = ("sdpa", self.n, q, k, self.fold(q, k), self.prov.sources(q), v)
                self.k_sources[self.n] = self.prov.sources(k)
            return
        if func is F.multi_head_attention_forward:
            super().record(func, name, args, kwargs, out)
            if len(attn.calls) > before:
                q, k = _mha_qk(args, kwargs)
                self.calls[before] = ("mha", -1, q, k, 1.0, attn.calls[before].q)
            return
        markers = len(attn.scores)
        super().record(func, name, args, kwargs, out)
        if len(attn.scores) > markers:  # a product of two activations: perhaps q.k
            got = _operands(name, args, kwargs)
            if got is not None:
                _, q, k, a, b = got
                self.products_at[Product(markers)] = (self.n, q, k, self.fold(a, b), self.prov.sources(a))
                self.k_sources[self.n] = self.prov.sources(b)
        if len(attn.calls) > before and before in attn.origin:  # a softmax over a product, or weights written out
            kind, product = attn.origin[before]
            if product in self.products_at and (kind == "softmax" or attn.calls[before].normalised):
                self.calls[before] = (kind, *self.products_at[product])


def _mha_qk(args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.MultiheadAttention's q and k per head (B, H, L, E), projected as the call does."""
    call = MHACall.of(args, kwargs)
    a = call.args
    H, dh = call.heads, call.embed_dim // call.heads
    wq, wk, _ = call.weights()
    bq, bk, _ = call.biases()
    qq = a["query"] if call.batched else a["query"][:, None]
    kk = a["key"] if call.batched else a["key"][:, None]
    q = F.linear(qq.detach().double(), wq.detach().double(), None if bq is None else bq.detach().double())
    k = F.linear(kk.detach().double(), wk.detach().double(), None if bk is None else bk.detach().double())
    L, B, S = q.shape[0], q.shape[1], k.shape[0]
    return (q.reshape(L, B, H, dh).permute(1, 2, 0, 3), k.reshape(S, B, H, dh).permute(1, 2, 0, 3))


def capture_scores(probe: Probe, x: torch.Tensor, targets: frozenset[int] = frozenset(), factor: float = 1.0,
                   grad: bool = False) -> list[Scores]:
    """Every attention call of one eval forward of x whose q and k could be read, in order; with targets, the q
    operand of those products (by ordinal) is scaled by factor first. grad: q stays the live tensor (for autograd)."""
    return trace_scores(probe, x, targets, factor, grad)[0]


def trace_scores(probe: Probe, x: torch.Tensor, targets: frozenset[int] = frozenset(), factor: float = 1.0,
                 grad: bool = False) -> tuple[list[Scores], ScoreTracer]:
    """capture_scores, and the tracer itself (which projections read rows that were all equal: uniform_in)."""
    module = probe.module
    tr = ScoreTracer(module, probe.d, targets, factor)
    tr.prov.watch(x)  # what reads the input's tokens, as the dataflow follows it (a product of two tables is no score)
    with train_mode(module, False), torch.set_grad_enabled(grad), tr:
        probe.subject(x.clone())
    out, B = [], x.shape[0]
    for i, c in enumerate(tr.attn.calls):
        got, info = tr.attn.captured.get(i), tr.calls.get(i)
        if got is None or info is None:
            continue
        kind, ordinal, q, k, fold, sources, *v = info
        logits = got.logits.to(probe.device)  # the tracer keeps scores on the CPU; the readers meet them with q and k
        if logits.ndim == 3 and logits.shape[0] % B == 0:  # (B * H, L, S), fairseq's and ESM's bmm: batch-major
            logits = logits.reshape(B, logits.shape[0] // B, *logits.shape[1:])
        q4, k4 = _heads(q, logits), _heads(k, logits)
        if k4 is not None and logits.ndim == 4 and logits.shape[-1] > k4.shape[-2]:
            logits = _without_sinks(logits, k4.shape[-2])
        if q4 is None or k4 is None or logits.ndim != 4 or q4.shape[-2] != logits.shape[-2] or k4.shape[-2] != logits.shape[-1]:
            continue
        if not grad:
            q4 = q4.detach().double()
        v4 = _heads(v[0], logits) if v and isinstance(v[0], torch.Tensor) else None
        out.append(Scores(kind, c.where, ordinal, q4, k4.detach().double(), fold, logits, sources,
                          None if v4 is None else v4.detach().double(), tr.k_sources.get(ordinal, ())))
    return out, tr
