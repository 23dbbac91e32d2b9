"""Spec reader: group-limited routing (DeepSeek's), read off which experts each token is routed to against the router's
outputs: the limits (experts in n_group groups, each token's top-k among its topk_group best) that choose so."""

from __future__ import annotations

import math

import torch

from tblock_cli.card.entries import Entry, skipped

# Group scores as group-limited routers compute them from the router's outputs z: DeepSeek-V2's greedy groups rank by
# their best expert (a softmax's or sigmoid's maximum ranks as z's), DeepSeek-V3's (and GLM-4.5's, dots1's, ...) by the
# sum of their two best sigmoid scores; the sums of the two best softmax scores or logits for other code.
GROUP_SCORES = {
    "max": lambda zg: zg.max(-1).values,
    "two best sigmoids": lambda zg: zg.sigmoid().topk(2, -1).values.sum(-1),
    "two best softmax scores": lambda zg: (zg - zg.amax((-2, -1), keepdim=True)).exp().topk(2, -1).values.sum(-1),
    "two best logits": lambda zg: zg.topk(2, -1).values.sum(-1),
}


def group_rules(z: torch.Tensor, routed: torch.Tensor, k: int) -> set[tuple[int, int, str]]:
    """The group limits whose choice is `routed` (N, E) for every token, given the router's outputs z (N, E) and k
    experts per token: (n_group, topk_group, layout) with the E experts in n_group groups of E / n_group, contiguous
    (expert e in group e // size, DeepSeek's) or strided (e % n_group), each token's top-k taken among the experts of
    its topk_group best groups, under any of GROUP_SCORES. Only limits that keep fewer groups than there are."""
    n, e = z.shape
    found = set()
    for groups in (g for g in range(2, e) if e % g == 0):
        size = e // groups
        for layout in ("contiguous", "strided"):
            zg = z.view(n, groups, size) if layout == "contiguous" else z.view(n, size, groups).transpose(1, 2)
            for name, score in GROUP_SCORES.items():
                if size < 2 and name != "max":
                    continue
                order = score(zg).argsort(-1, descending=True)
                for kept in range(-(-k // size), groups):
                    keep = torch.zeros(n, groups, dtype=torch.bool).scatter_(-1, order[:, :kept], True)
                    keep = keep[:, :, None].expand(n, groups, size)
                    keep = keep.reshape(n, e) if layout == "contiguous" else keep.transpose(1, 2).reshape(n, e)
                    idx = z.masked_fill(~keep, -math.inf).topk(k, -1).indices
                    if bool(torch.zeros_like(routed).scatter_(-1, idx, True).eq(routed).all()):
                        found.add((groups, kept, layout))
    return found


def group_word(rule: tuple[int, int, str]) -> str:
    """A group limit as the card writes it: "8/4" (8 contiguous groups, 4 kept), "8/4 strided"."""
    groups, kept, layout = rule
    return f"{groups}/{kept}" + (" strided" if layout == "strided" else "")


# A probe of few tokens (4 where there are many experts) fits many limits alike: past this many, none is read
MAX_LIMITS = 12


def groups_entry(z: torch.Tensor, routed: torch.Tensor, counts: torch.Tensor, plain: bool) -> Entry:
    """moe.groups: the group limits that choose every token's experts as the block does, the ones this probe cannot
    tell apart: "none" first where the choice is the plain top-k (a limit that keeps each token's k best experts'
    groups chooses so too, by construction or on these tokens), each limit's word ("8/4") beside it. A claim holds
    where it is among them. Unread where the choice is not the top-k and no limit explains it (a selection bias,
    another rule), where the tokens take different counts, and where more than MAX_LIMITS fit."""
    k = int(counts.max())
    if not bool((counts == k).all()) or k == 0:
        return skipped("moe.groups", "experts per token vary over tokens: no fixed top-k to limit")
    n = z.shape[0]
    words = (("none",) if plain else ()) + tuple(sorted({group_word(r) for r in group_rules(z, routed, k)},
                                                       key=lambda w: (len(w), w)))
    if not words:
        return skipped("moe.groups", "the choice is not the top-k and no group limit explains it (a selection bias, "
                                     "another rule)")
    if len(words) > MAX_LIMITS:
        return skipped("moe.groups", f"{len(words)} group limits choose as the block does for these {n} tokens: "
                                     f"not told apart")
    how = (f"each of {n} tokens takes its top-{k} experts" if plain else
           f"each of {n} tokens takes its top-{k} experts among those of its best groups")
    return Entry("moe.groups", words, how=how + (f", as {len(words)} limits alike choose" if len(words) > 1 else ""))
