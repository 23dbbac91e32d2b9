"""Blocks that try to end the process (os._exit, sys.exit) in their forward, for tests/test_cli_edges.py."""

import os
import sys

import torch.nn as nn


class OsExitInForward(nn.Module):
    def __init__(self, d_model=64):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        os._exit(0)


class SysExitInForward(OsExitInForward):
    def forward(self, x):
        sys.exit(0)


class OsExitAfterLoading(OsExitInForward):
    """Passes the load probe, then ends the process on a later forward (inside the battery)."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        if type(self).calls > 1:
            os._exit(0)
        return x + self.proj(x)


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


from zoo import LlamaTP  # noqa: E402 - the zoo is on the path wherever this file is loaded from


class DiesOnRank1(LlamaTP):
    """Correct on one process; under --tp 2 rank 1 ends with exit code 3, and rank 0 sees gloo's `[/path...]` error."""

    def forward(self, x, *args, **kwargs):
        if _rank() == 1:
            os._exit(3)
        return super().forward(x, *args, **kwargs)
