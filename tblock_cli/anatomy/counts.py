"""FLOPs and output shapes per projection and module, as one traced forward sees them (torchinfo's statistics)."""

from __future__ import annotations


class Counts:
    """Multiply-add FLOPs (2 per multiply-add) per projection, and the last output shape of each projection or module."""

    def __init__(self):
        self.flops: dict[str, int] = {}
        self.out_shape: dict[str, tuple] = {}

    def add(self, name: str, flops: int, shape: tuple) -> None:
        """A call of projection `name`: its FLOPs add up over calls, its shape is the last one's."""
        self.flops[name] = self.flops.get(name, 0) + flops
        self.out_shape[name] = shape

    def projection(self, proj: str, weight, x, out, fan_in: int) -> None:
        """out = x W^T (or x W): 2 * |W| FLOPs per input row of width fan_in."""
        self.add(proj, 2 * weight.numel() * (x.numel() // max(1, fan_in)), tuple(out.shape))
