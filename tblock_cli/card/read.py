"""Reading a card: every reader over one float64 probe of the block, each reader's slip counted, never guessed."""

from __future__ import annotations

from typing import Callable

import torch

from tblock_cli.card import attention, biases, ffn, moe, norms, positions, residual
from tblock_cli.card.entries import KEYS, Card, Entry, skipped
from tblock_cli.card.probe import Probe, float64_probe
from tblock_cli.errors import is_out_of_memory, one_line

# Each reader: (name, function of the probe -> entries). A reader that raises leaves its keys unread with the error
# as the reason, and the slip is a fact on the card.
READERS: tuple[tuple[str, Callable[[Probe], list[Entry]]], ...] = (
    ("attention", attention.read),
    ("positions", positions.read),
    ("ffn", ffn.read),
    ("moe", moe.read),
    ("norms", norms.read),
    ("residual", residual.read),
    ("biases", biases.read),
)


# The readers whose entries a key needs (a check judging a few keys runs only those).
READS = {"attn": "attention", "pos": "positions", "rope": "positions", "alibi": "positions", "relbias": "positions",
         "ffn": "ffn", "moe": "moe", "norm": "norms", "residual": "residual", "bias": "biases"}


def read_card(subject, cfg, device: torch.device, progress: Callable[[str], None] | None = None,
              keys: tuple[str, ...] | None = None) -> Card:
    """The card of `subject` (a loading.Subject), read off a float64 copy of it; the subject is not changed. With
    keys, only the readers those keys need run (the others' entries are left unread)."""
    wanted = None if keys is None else {READS[k.partition(".")[0]] for k in keys}
    probe = float64_probe(subject, cfg, device)
    if keys is not None:
        probe.memo["keys"] = set(keys)  # a reader may leave out the probes no wanted key needs
    entries: dict[str, Entry] = {}
    slips = []
    for name, reader in READERS:
        if wanted is not None and name not in wanted:
            continue
        if progress is not None:
            progress(name)
        try:
            got = reader(probe)
        except Exception as e:  # noqa: BLE001 - one reader's slip leaves its own keys unread, the rest still read
            if is_out_of_memory(e):
                raise
            slips.append(f"{name}: {one_line(e)}")
            continue
        for e in got:
            entries.setdefault(e.key, e)
    ordered = tuple(entries.get(k) or skipped(k, "not measured for this block") for k in KEYS)
    return Card(subject.name, ordered, tuple(slips))
