"""Weights carried from block A to block B: by parameter name, else by dataflow role, as a list of slot pairs.

A slot is one piece of a parameter with one role, in the (out, in) layout of `nn.Linear`: a whole weight, or the
k rows of a fused q/k/v projection, or the q third of `nn.MultiheadAttention.in_proj_weight`, or a GPT-2 `Conv1D`
weight read transposed. Two blocks agree on a slot's meaning through the traced dataflow (`anatomy.trace`), not
through their module names; a name is trusted first because that is what loading a checkpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.anatomy.provenance import owns_several_matrices, qualified
from tblock_cli.errors import ConfigError

# Parameter names too generic to match on alone: `weight` of one module says nothing about another's.
GENERIC = ("weight", "bias")


@dataclass(frozen=True)
class Slot:
    """One role's piece of one parameter."""

    param: str  # qualified parameter name
    role: str  # attn.q, attn.k, attn.v, attn.out, ffn.in, ffn.gate, ffn.out, norm, other
    part: str  # weight | bias
    rows: tuple[int, int] | None = None  # a row range of the (out, in)-oriented tensor; None: all of it
    transposed: bool = False  # stored (in, out), as GPT-2's Conv1D
    order: int = 0  # when its module first ran: pairs the k-th norm of A with the k-th norm of B
    why: str = ""  # why a fused parameter stayed whole (its rows could not be given roles): said if it stays unmatched

    @property
    def label(self) -> str:
        return self.param + (f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else "")

    def get(self, tensors: dict) -> torch.Tensor:
        t = tensors[self.param]
        t = t.t() if self.transposed and t.ndim == 2 else t
        return t[self.rows[0]:self.rows[1]] if self.rows else t

    def set(self, tensors: dict, value: torch.Tensor) -> None:
        self.get(tensors).copy_(value.to(tensors[self.param].dtype))


@dataclass(frozen=True)
class Mapping:
    """How A's weights reached B: slot pairs and how each was found, one-sided biases zeroed, name/role conflicts."""

    pairs: tuple[tuple[Slot, Slot, str], ...]  # (A slot, B slot, "name" | "role" | "map")
    zeroed: tuple[tuple[str, str], ...] = ()  # (side, parameter): a bias the other side lacks, set to zero
    disagreements: tuple[tuple[str, str, str, str], ...] = ()  # (A name, A role, B name, B role)
    at_init: tuple[tuple[str, str, str], ...] = ()  # (side, parameter, "ones" | "zeros"): an unmatched norm-like
    # weight left as it was, where it computes the identity (a weighted q/k-norm against a weight-free one)

    def carry(self, a: nn.Module, b: nn.Module) -> None:
        pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
        with torch.no_grad():
            for side, name in self.zeroed:
                (pa if side == "a" else pb)[name].zero_()
            for sa, sb, _ in self.pairs:
                sb.set(pb, sa.get(pa))

    def counts(self) -> dict[str, int]:
        out = {"name": 0, "role": 0, "map": 0}
        for _, _, how in self.pairs:
            out[how] += 1
        return out


def execution_order(module: nn.Module, call, x: torch.Tensor) -> dict[str, int]:
    """Module name -> the index of its first call in one eval forward."""
    order: dict[str, int] = {}

    def first_call(name):
        def hook(_m, _args):
            order.setdefault(name, len(order))  # returns None: the module's inputs stay as they are
        return hook
    hooks = [m.register_forward_pre_hook(first_call(n)) for n, m in module.named_modules()]
    try:
        was = module.training
        module.eval()
        with torch.no_grad():
            call(x)
    finally:
        module.train(was)
        for h in hooks:
            h.remove()
    return order


def fused_widths(rows: int, role: str, flow) -> list[tuple[str, int]] | None:
    """A fused projection's row split: q is heads x head_dim of its attention call, k and v share the rest. None where
    no split tiles the rows exactly (a width the roles cannot account for): a row is never dropped."""
    parts = role.split(".")[1]
    call = next(iter(flow.attention), None)
    q = call.heads * call.head_dim if call is not None and "q" in parts else None
    if parts == "qkv":
        q = q if q is not None and (rows - q) % 2 == 0 and rows > q else rows // 3 if rows % 3 == 0 else None
        return None if q is None else [("attn.q", q), ("attn.k", (rows - q) // 2), ("attn.v", (rows - q) // 2)]
    return None if rows % 2 else [(f"attn.{parts[0]}", rows // 2), (f"attn.{parts[1]}", rows // 2)]


def slots_of(module: nn.Module, flow, order: dict[str, int]) -> list[Slot]:
    """Every parameter of the module as slots with roles, fused projections split."""
    roles = {m.name: m.role for m in flow.modules}
    slots: list[Slot] = []
    for mname, m in module.named_modules():
        when = order.get(mname, len(order))
        if isinstance(m, nn.MultiheadAttention):
            used = roles.get(qualified(mname, "q"), "other") != "other"
            E = m.embed_dim
            for pn, p in m.named_parameters(recurse=False):
                full = qualified(mname, pn)
                if pn in ("in_proj_weight", "in_proj_bias"):
                    part = "weight" if p.ndim == 2 else "bias"
                    slots += [Slot(full, f"attn.{r}" if used else "other", part, (i * E, (i + 1) * E), False, when)
                              for i, r in enumerate("qkv")]
                elif pn in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                    slots.append(Slot(full, f"attn.{pn[0]}" if used else "other", "weight", None, False, when))
                else:
                    slots.append(Slot(full, "other", "bias", None, False, when))
            continue
        several = owns_several_matrices(m)
        conv1d = type(m).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight (in, out)
        for pn, p in m.named_parameters(recurse=False):
            full = qualified(mname, pn)
            role = roles.get(full if several else (mname or "(root)"), "other")
            part = ("bias" if "bias" in pn else "weight") if role == "norm" else ("weight" if p.ndim >= 2 else "bias")
            transposed = conv1d and p.ndim == 2
            widths = fused_widths(p.shape[1] if transposed else p.shape[0], role, flow) \
                if role in ("attn.qkv", "attn.qk", "attn.kv") else None
            if widths is not None:
                start = 0
                for r, width in widths:
                    slots.append(Slot(full, r, part, (start, start + width), transposed, when))
                    start += width
            else:
                why = f"its {p.shape[1] if transposed else p.shape[0]} rows do not split evenly into " \
                      f"{', '.join(role.split('.')[1])}" if role in ("attn.qkv", "attn.qk", "attn.kv") else ""
                slots.append(Slot(full, role, part, None, transposed, when, why))
    return slots


def suffix_len(a: str, b: str) -> int:
    """How many trailing name components agree (a bare `weight`/`bias` alone does not count)."""
    ca, cb = a.split("."), b.split(".")
    n = 0
    while n < min(len(ca), len(cb)) and ca[-1 - n] == cb[-1 - n]:
        n += 1
    return 0 if n == 1 and ca[-1] in GENERIC else n


def by_name(a_params: dict, b_params: dict) -> dict[str, str]:
    """A name -> B name where the longest common name suffix picks one parameter each way, of one shape."""
    def best(name, others):
        scored = sorted(((suffix_len(name, o), o) for o in others), reverse=True)
        if not scored or scored[0][0] == 0 or (len(scored) > 1 and scored[1][0] == scored[0][0]):
            return None
        return scored[0][1]
    out = {}
    for a, ta in a_params.items():
        b = best(a, b_params)
        if b is not None and best(b, a_params) == a and tuple(ta.shape) == tuple(b_params[b].shape):
            out[a] = b
    return out


def read_map(path: str | None) -> dict[str, str]:
    if path is None:
        return {}
    from tblock_cli.report import read_json

    data = read_json(path, "--map", "an object of A parameter name -> B parameter name")
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ConfigError(f"--map {path}: give a JSON object of A parameter name -> B parameter name")
    return data


def build_mapping(a: nn.Module, b: nn.Module, slots_a: list[Slot], slots_b: list[Slot], overrides: dict[str, str]) -> Mapping:
    """Pairs for every slot of both sides, or a ConfigError naming what could not be paired."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for k, v in overrides.items():
        if k not in pa or v not in pb:
            missing = [f"A has no {k}" for _ in (0,) if k not in pa] + [f"B has no {v}" for _ in (0,) if v not in pb]
            raise ConfigError(f"--map: {'; '.join(missing)}")
    named = {**{k: v for k, v in by_name(pa, pb).items() if k not in overrides and v not in overrides.values()}, **overrides}
    pairs, disagreements = [], []
    for an, bn in named.items():
        sa = [s for s in slots_a if s.param == an]
        sb = [s for s in slots_b if s.param == bn]
        how = "map" if an in overrides else "name"
        whole_a = Slot(an, sa[0].role if sa else "other", sa[0].part if sa else "weight", None, sa[0].transposed if sa else False)
        whole_b = Slot(bn, sb[0].role if sb else "other", sb[0].part if sb else "weight", None, sb[0].transposed if sb else False)
        if tuple(whole_a.get(pa).shape) != tuple(whole_b.get(pb).shape):
            raise ConfigError(f"--map: A's {an} {tuple(whole_a.get(pa).shape)} and B's {bn} {tuple(whole_b.get(pb).shape)} differ in shape")
        pairs.append((whole_a, whole_b, how))
        ra, rb = [s.role for s in sa], [s.role for s in sb]
        if ra != rb and "other" not in ra + rb:
            disagreements.append((an, "/".join(ra), bn, "/".join(rb)))
    left_a = [s for s in slots_a if s.param not in named]
    left_b = [s for s in slots_b if s.param not in named.values()]
    pairs_r, left_a, left_b = by_role(left_a, left_b, pa, pb)
    pairs += pairs_r
    zeroed = []
    for side, left, paired in (("a", left_a, {p[0].param for p in pairs}), ("b", left_b, {p[1].param for p in pairs})):
        for s in list(left):  # a bias the other side lacks, none of whose pieces was paired: zero is its equivalent
            if s.part == "bias" and s.role != "other" and s.param not in paired:
                zeroed.append((side, s.param))
                left.remove(s)
    at_init, left_a, left_b = identity_extras(left_a, left_b, pa, pb, pairs)
    if left_a or left_b:
        said = [f"A's {s.label} ({s.role}{why_unmatched(s, pa[s.param])})" for s in left_a] + \
               [f"B's {s.label} ({s.role}{why_unmatched(s, pb[s.param])})" for s in left_b]
        raise ConfigError(f"cannot carry the weights across: nothing matches {', '.join(said)}; "
                          f"pass --map FILE (JSON: A parameter name -> B parameter name)")
    return Mapping(tuple(pairs), tuple(dict.fromkeys(zeroed)), tuple(disagreements), at_init)


def identity_value(p: torch.Tensor) -> str | None:
    """'ones' or 'zeros' for a 1-D parameter at the value where a norm's scale or shift (or a (1 + w) offset scale)
    computes the identity, as Hugging Face initialises them; None for anything else."""
    if p.ndim != 1 or not p.numel():
        return None
    if bool((p == 1).all()):
        return "ones"
    return "zeros" if bool((p == 0).all()) else None


def why_unmatched(s: Slot, p: torch.Tensor) -> str:
    return f"; {s.why}" if s.why else why_not_identity(p)


def why_not_identity(p: torch.Tensor) -> str:
    if p.ndim != 1:
        return ""
    return "; a 1-D weight not at the identity (ones or zeros), so leaving it out would change what that side computes"


def identity_extras(left_a: list[Slot], left_b: list[Slot], pa: dict, pb: dict, pairs):
    """Unmatched parameters of one side that are norm-like weights at their identity (a weighted q/k-norm at its
    init against a weight-free one): left as they are, and said. Anything else stays unmatched (refused)."""
    out = []
    rest = []
    for side, left, params, paired in (("a", left_a, pa, {p[0].param for p in pairs}),
                                       ("b", left_b, pb, {p[1].param for p in pairs})):
        keep = []
        for s in left:
            value = identity_value(params[s.param]) if s.param not in paired else None
            if value is None:
                keep.append(s)
            else:
                out.append((side, s.param, value))
        rest.append(keep)
    return tuple(dict.fromkeys(out)), rest[0], rest[1]


def by_role(left_a: list[Slot], left_b: list[Slot], pa: dict, pb: dict):
    """The k-th slot of a role and part in A (in execution order) with the k-th of B, when their shapes agree."""
    def ranked(slots):
        out: dict[tuple, list[Slot]] = {}
        for s in sorted(slots, key=lambda s: s.order):
            out.setdefault((s.role, s.part), []).append(s)
        return out
    ra, rb = ranked(left_a), ranked(left_b)
    pairs, used_a, used_b = [], set(), set()
    for key, sa_list in ra.items():
        for sa, sb in zip(sa_list, rb.get(key, [])):
            if tuple(sa.get(pa).shape) == tuple(sb.get(pb).shape):
                pairs.append((sa, sb, "role"))
                used_a.add(sa)
                used_b.add(sb)
    return pairs, [s for s in left_a if s not in used_a], [s for s in left_b if s not in used_b]
