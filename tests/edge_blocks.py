"""Blocks that misbehave at the edges of the process: exiting, writing to file descriptor 1, running slowly."""

import os
import sys
import time

from zoo import Good


class ExitsInTraining(Good):
    """Calls sys.exit(0) in its training forward: tblock must report it, not exit 0 with nothing printed."""

    def forward(self, x, pad_mask=None):
        if self.training:
            sys.exit(0)
        return super().forward(x, pad_mask)


class ExitsWithMessage(Good):
    """sys.exit("msg") in training: not exit 1 with just the message."""

    def forward(self, x, pad_mask=None):
        if self.training:
            sys.exit("the block gave up")
        return super().forward(x, pad_mask)


class WritesToFd1(Good):
    """Writes straight to file descriptor 1, as C extensions do: --json must stay valid on stdout."""

    def forward(self, x, pad_mask=None):
        os.write(1, b"raw bytes on fd 1\n")
        return super().forward(x, pad_mask)


class Slow(Good):
    """Sleeps in every forward, so a run is still measuring when it is interrupted. Each forward adds a byte to the file
    that SLOW_FORWARDS names: a test interrupts once the run measures, rather than after a guessed delay."""

    def forward(self, x, pad_mask=None):
        if os.environ.get("SLOW_FORWARDS"):
            with open(os.environ["SLOW_FORWARDS"], "a") as f:
                f.write(".")
        time.sleep(0.05)
        return super().forward(x, pad_mask)


class MaskFirst(Good):
    """Takes its input as `x` and the mask as `mask`: --pad-keyword x names the input, not a mask keyword."""

    def forward(self, x, mask=None):
        return super().forward(x, mask)
