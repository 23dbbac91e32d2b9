"""Where two blocks part ways on the cached (decode) path only: the first decode step whose outputs differ, and the
first role output captured in that step that differs, each side run from its own cache as it stood before the step."""

from __future__ import annotations

import copy

import torch

from tblock_cli.comparing.localise import capture, component_diffs
from tblock_cli.probes import train_mode
from tblock_cli.subject.kvcache import decode_step


def decode_sizes(T: int) -> list[int]:
    """A prompt of half the sequence, then one token at a time (as compare_all decodes)."""
    return [T // 2] + [1] * (T - T // 2)


def localise_decode(sa, sb, xa: torch.Tensor, xb: torch.Tensor, slots_a, slots_b, judge) -> dict | None:
    """{path: decode, step, positions, rel, max_abs, and component (the first captured role output that differs in
    that step) where one does}; None where every step agrees."""
    caches = [None, None]
    start = 0
    with train_mode(sa.module, False), train_mode(sb.module, False), torch.no_grad():
        for step, n in enumerate(decode_sizes(xa.shape[1])):
            chunk = (xa[:, start:start + n], xb[:, start:start + n])
            before = [copy.deepcopy(c) for c in caches]
            ya, caches[0] = decode_step(sa.module, chunk[0].clone(), caches[0])
            yb, caches[1] = decode_step(sb.module, chunk[1].clone(), caches[1])
            c = judge("decode", yb, ya)
            if not c.equal:
                facts = {"path": "decode", "step": step, "positions": [start, start + n - 1], "rel": c.rel,
                         "max_abs": c.max_abs}
                first = first_in_step(sa, sb, chunk, before, slots_a, slots_b, judge.component_tol)
                return {**facts, **first} if first else facts
            start += n
    return None


def first_in_step(sa, sb, chunk, before, slots_a, slots_b, tol: float) -> dict | None:
    """The first role output that differs when each side decodes `chunk` from a copy of its cache before it."""
    caps = []
    for s, x, cache, slots in ((sa, chunk[0], before[0], slots_a), (sb, chunk[1], before[1], slots_b)):
        own = copy.deepcopy(cache)
        caps.append(capture(s.module, lambda t, _m=s.module, _c=own: decode_step(_m, t, _c)[0], x.clone(), slots))
    first = next((d for d in component_diffs(*caps) if d.rel > tol), None)
    if first is None:
        return None
    return {"component": first.component, "rel": first.rel, "max_abs": first.max_abs}
