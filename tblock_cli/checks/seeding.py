"""Whether a block's construction follows torch's seed: built again at the run's seed, it holds the same parameters
and buffers bit for bit, whatever Python's and NumPy's streams hold (the `state_dict` check's twin builds)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.checks.context import Context
from tblock_cli.checks.holdings import roots
from tblock_cli.probes import STREAMS_APART

# Python's and NumPy's streams seeded this far from the run's seed while the twin is built (torch's as asked)
OTHER_STREAMS = 7919


@contextmanager
def streams_apart(offset: int = OTHER_STREAMS):
    """Within: `reseed` seeds Python's and NumPy's streams at the seed plus offset, torch's as asked; a build that
    draws from those streams then comes out otherwise, one that draws from torch's alone the same."""
    STREAMS_APART[0] = offset
    try:
        yield
    finally:
        STREAMS_APART[0] = 0


def built_apart(ctx: Context) -> tuple[str, list[str]] | None:
    """Whether the block's construction follows torch's seed: built again at the run's seed, with Python's and NumPy's
    streams seeded otherwise, it must hold the same parameters and buffers, bit for bit. None where it does (or where
    only the block's own state moved during the battery: two fresh builds agree); ("streams", names) where it draws
    from Python's or NumPy's stream (torch.manual_seed alone does not reproduce it); ("unseeded", names) where two
    builds at one seed of every stream differ (the clock, a global stream reseeded in the constructor, memory
    torch.empty left unwritten)."""
    ctx.step("built again at the same seed")
    rebuild, seed = ctx.subject.rebuild, ctx.cfg.seed
    with streams_apart():
        other = rebuild(seed, "cpu")
    if not state_apart(ctx.subject.module, other):
        return None
    first = rebuild(seed, "cpu")
    names = state_apart(other, first)
    if not names:
        return None  # the block's own state moved during the battery (running statistics, a cache): builds agree
    again = state_apart(first, rebuild(seed, "cpu"))
    return ("unseeded", again) if again else ("streams", names)


def state_apart(a: nn.Module, b: nn.Module) -> list[str]:
    """The parameters and buffers (by name, over each root) that two modules do not hold alike, bit for bit (NaN
    equal to NaN: memory left unwritten may hold some); one only one of them holds counts too."""
    out = []
    for i, (ra, rb) in enumerate(zip(roots(a), roots(b))):
        ta = {**dict(ra.named_parameters()), **dict(ra.named_buffers())}
        tb = {**dict(rb.named_parameters()), **dict(rb.named_buffers())}
        prefix = f"{i}." if i else ""
        out += [prefix + n for n in sorted(set(ta) ^ set(tb))]
        for n in sorted(set(ta) & set(tb)):
            u, v = ta[n], tb[n]  # named_parameters and named_buffers hold no None
            if u.shape != v.shape:
                out.append(prefix + n)
                continue
            if u.dtype != v.dtype or u.is_meta or v.is_meta:  # no values to hold alike
                continue
            u, v = u.detach().cpu(), v.detach().cpu()
            if torch.equal(u, v):
                continue
            if u.is_floating_point() or u.is_complex():
                same = (u == v) | (u.isnan() & v.isnan())
                if bool(same.all()):
                    continue
            out.append(prefix + n)
    return sorted(out)
