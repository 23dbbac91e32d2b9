"""Roles from the traced dataflow: which projections are attention q/k/v/out, which form the FFN, and one row per module."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tblock_cli.anatomy.provenance import ACT, Attn, Marker, qualified
from tblock_cli.anatomy.tracer import Tracer

ATTENTION_ROLES = ("attn.q", "attn.k", "attn.v", "attn.qk", "attn.kv", "attn.qkv", "attn.out", "attn.gate", "attn.inner")
FFN_ROLES = ("ffn.in", "ffn.gate", "ffn.out")
GROUPS = ("attention", "ffn", "norm", "other")
# A projection that reads only constants of the block (a timestep's or a class's embedding; adaLN's modulation): not
# the stream's, counted with "other" but not among the parameters the FFN-share check calls stray.
COND = "other.cond"


@dataclass(frozen=True)
class ModuleUse:
    """A module that owns parameters, with the role the dataflow gave it."""

    name: str
    role: str  # attn.q ... attn.out, ffn.in / ffn.gate / ffn.out, norm, other, other.cond (COND)
    params: int  # its own parameters not already counted for another module
    matrix_params: int  # of which weight matrices (ndim >= 2)
    out_shape: tuple[int, ...] | None  # on the probe input
    flops: int  # forward matmul FLOPs it ran on the probe input

    @property
    def group(self) -> str:
        return group_of(self.role)



def group_of(role: str) -> str:
    return role.split(".")[0].replace("attn", "attention") if role not in ("norm", "other") else role



def attn_role(letters: set[str], otherwise: str) -> str:
    """attn.q, attn.kv, ... for what a projection feeds (q, k and v letters, in that order); `otherwise` for q and v
    without k, which no known layout has."""
    key = "".join(x for x in "qkv" if x in letters)
    return "attn." + key if key in ("q", "k", "v", "qk", "kv", "qkv") else otherwise


def assign_roles(tr: Tracer) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """projection name -> role, and the FFN chains that compose linearly."""
    role: dict[str, str] = {}
    qs = {n for c in tr.attn.calls for n in c.q}
    ks = {n for c in tr.attn.calls for n in c.k}
    vs = {n for c in tr.attn.calls for n in c.v}
    for n in qs | ks | vs:
        role[n] = attn_role({x for x, s in (("q", qs), ("k", ks), ("v", vs)) if n in s}, "attn.qkv")
    for n, p in tr.prov.linear_in.items():
        if n not in role and any(isinstance(k, Attn) for k in p):
            role[n] = "attn.out"
    for n in [n for n, r in role.items() if r == "attn.out"]:  # a gate on the attention output (afmoe, qwen3_next)
        for src in tr.prov.linear_in.get(n, {}):
            if src in tr.prov.linear_in and src not in role:
                role[src] = "attn.gate"
    for n in [n for n, r in role.items() if r not in ("attn.out", "attn.gate")]:
        src = list(tr.prov.linear_in.get(n, {}))
        if len(src) == 1 and src[0] in tr.prov.linear_in:  # fed by one projection alone (low rank, MLA)
            if src[0] not in role:
                role[src[0]] = role[n]
            elif role[src[0]] not in ("attn.out", "attn.gate") and role[n].startswith("attn."):
                # MLA's kv_a_proj feeds kv_b_proj (k and v) and, copied into the keys, the rotary part of k: both
                role[src[0]] = attn_role(set(role[src[0]][5:]) | set(role[n][5:]), role[src[0]])
    # FFN: a projection that consumes another (non-attention) projection's output.
    # Projections that read no tensor of the block's input (adaLN's modulation of a timestep embedding, its MLP) are
    # conditioning, in no chain of the FFN's.
    chains = []
    consumed: dict[str, list[tuple[str, int]]] = {}
    cond = tr.prov.reads_constant
    for n, p in tr.prov.linear_in.items():
        if n in role or cond(n):
            continue
        preds = [(s, f) for s, f in p.items()
                 if not isinstance(s, Marker) and s in tr.prov.linear_in and s not in role and not cond(s)]
        if preds:
            consumed[n] = preds
    for out_name, preds in consumed.items():
        role.setdefault(out_name, "ffn.out")
        acted = {s for s, f in preds if f & ACT}
        for s, f in preds:
            if s in consumed:  # the middle of a longer chain: both consumes and is consumed
                role[s] = "ffn.in" if role.get(s) in (None, "ffn.out") else role[s]
                tr.prov.ffn_middles.add(s)
            else:
                role[s] = "ffn.gate" if (s in acted and len(acted) < len(preds)) else "ffn.in"
            if not f:
                chains.append((s, out_name))
    # A projection no other consumes, beside FFN projections in the same module (a mixture-of-experts layer's
    # shared-expert gate, sigmoid(gate(x)) * shared_expert(x)): part of that FFN.
    ffn_parents = {n.rpartition(".")[0] for n, r in role.items() if r.startswith("ffn")}
    for n in tr.prov.linear_in:
        parent = n.rpartition(".")[0]
        if n not in role and parent and any(p == parent or p.startswith(parent + ".") for p in ffn_parents):
            role[n] = "ffn.gate" if not cond(n) else COND
        elif n not in role and cond(n):
            role[n] = COND
    return role, chains


def mha_rows(name: str, m: nn.MultiheadAttention, tr: Tracer, role: dict, seen: set) -> list[ModuleUse]:
    """nn.MultiheadAttention's own parameters as q, k, v rows (in_proj split, biases with their matrix)."""
    E = m.embed_dim
    if m.in_proj_weight is not None:
        key = qualified(name, "in_proj_weight")
        mats = {"q": E * E, "k": E * E, "v": E * E}
        first = m.in_proj_weight
    else:
        key = qualified(name, "q_proj_weight")
        mats = {"q": m.q_proj_weight.numel(), "k": m.k_proj_weight.numel(), "v": m.v_proj_weight.numel()}
        first = m.q_proj_weight
    if id(first) in seen:
        return []
    for p in m.parameters(recurse=False):
        seen.add(id(p))
    extra = {"q": 0, "k": 0, "v": 0}
    if m.in_proj_bias is not None:
        extra = {k: E for k in extra}
    for k, b in (("k", m.bias_k), ("v", m.bias_v)):
        if b is not None:
            extra[k] += b.numel()
    used = key in role
    flops = tr.counts.flops.get(key, 0)
    total_mats = sum(mats.values())
    return [ModuleUse(f"{name}.{k}", f"attn.{k}" if used else "other", mats[k] + extra[k], mats[k], tr.counts.out_shape.get(key),
                      flops * mats[k] // total_mats) for k in ("q", "k", "v")]

