"""A fused q/k/v projection split in another order than the other side's: the orders its rows could be taken in are
tried, and the one that makes the two blocks agree is named (A fuses [k, q, v] where B's roles read [q, k, v])."""

from __future__ import annotations

import dataclasses
from itertools import permutations

import torch

from tblock_cli.probes import train_mode

ROLES = ("attn.q", "attn.k", "attn.v")


def fused_groups(mapping) -> list[tuple[int, list[int]]]:
    """(side, indices of mapping.pairs) for each side with a parameter split into q, k and v rows; side 0 is A."""
    out = []
    for side in (0, 1):
        by_param: dict[str, dict[str, int]] = {}
        for i, pair in enumerate(mapping.pairs):
            s = pair[side]
            if s.rows is not None and s.role in ROLES:
                by_param.setdefault(s.param, {})[s.role] = i
        full = [i for roles in by_param.values() if set(roles) == set(ROLES) for i in roles.values()]
        if full:
            out.append((side, full))
    return out


def reordered(mapping, side: int, indices: list[int], order: tuple[str, ...], params: tuple[dict, dict]):
    """The mapping with the fused side's rows taken in `order` (each role's width from the other side's slot)."""
    pairs = list(mapping.pairs)
    by_param: dict[str, list[int]] = {}
    for i in indices:
        by_param.setdefault(pairs[i][side].param, []).append(i)
    for own in by_param.values():
        role_of = {pairs[i][side].role: i for i in own}
        start = 0
        for role in order:
            i = role_of[role]
            other = pairs[i][1 - side]
            width = other.get(params[1 - side]).shape[0]
            slot = dataclasses.replace(pairs[i][side], rows=(start, start + width))
            pairs[i] = (slot, other, pairs[i][2]) if side == 0 else (other, slot, pairs[i][2])
            start += width
        whole = dataclasses.replace(pairs[own[0]][side], rows=None).get(params[side])
        if start != whole.shape[0]:  # the other side's widths do not tile this parameter
            return None
        widths = {r: pairs[role_of[r]][1 - side].get(params[1 - side]).shape[0] for r in ROLES}
        pairs = split_whole(pairs, side, pairs[own[0]][side].param, widths, order, params)
    return dataclasses.replace(mapping, pairs=tuple(pairs))


def split_whole(pairs: list, side: int, fused: str, widths: dict, order, params) -> list:
    """A fused bias carried whole by name (both sides fused: GPT-2's c_attn.bias) split like its weight: this side's
    rows in `order`, the other side's in q, k, v."""
    owner = fused.rpartition(".")[0]
    total = sum(widths.values())
    out = []
    for pair in pairs:
        own, other = pair[side], pair[1 - side]
        t = params[side][own.param]
        if own.rows is not None or other.rows is not None or own.param.rpartition(".")[0] != owner or \
                own.param == fused or t.ndim != 1 or t.shape[0] != total or params[1 - side][other.param].shape != t.shape:
            out.append(pair)
            continue
        starts, at = {}, 0
        for r in order:
            starts[r], at = at, at + widths[r]
        at = 0
        for r in ROLES:
            mine = dataclasses.replace(own, role=r, rows=(starts[r], starts[r] + widths[r]))
            theirs = dataclasses.replace(other, role=r, rows=(at, at + widths[r]))
            at += widths[r]
            out.append((mine, theirs, pair[2]) if side == 0 else (theirs, mine, pair[2]))
    return out


def fused_order(sa, sb, xa: torch.Tensor, xb: torch.Tensor, mapping, judge) -> dict | None:
    """The order of a fused q/k/v split under which the outputs agree, where the order as carried (q, k, v) makes them
    differ; B's weights are carried back as they were."""
    groups = fused_groups(mapping)
    if not groups:
        return None
    params = (dict(sa.module.named_parameters()), dict(sb.module.named_parameters()))
    try:
        for side, indices in groups:
            for order in permutations(ROLES):
                if order == ROLES:
                    continue
                m = reordered(mapping, side, indices, order, params)
                if m is None:
                    continue
                m.carry(sa.module, sb.module)
                with train_mode(sa.module, False), train_mode(sb.module, False), torch.no_grad():
                    same = judge("outputs", sb(xb.clone()), sa(xa.clone())).equal
                if same:
                    names = sorted({pr[side].param for pr in m.pairs if pr[side].rows is not None and pr[side].role in ROLES})
                    return {"side": "AB"[side], "params": names, "order": ", ".join(r.split(".")[1] for r in order)}
    finally:
        mapping.carry(sa.module, sb.module)
    return None
