"""Which process speaks: under torchrun every rank runs the command and only rank 0 prints. No torch here, so the
CLI can ask before anything heavy is imported."""

from __future__ import annotations

import contextlib
import os


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def is_rank_zero() -> bool:
    return not under_torchrun() or os.environ.get("RANK") == "0"


@contextlib.contextmanager
def quiet_unless_rank_zero():
    """Under torchrun every rank runs the command; only rank 0 speaks."""
    if is_rank_zero():
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield
