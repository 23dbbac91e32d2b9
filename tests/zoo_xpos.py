"""torchscale's XPos written as its code does: in the forward, an einsum of the positions and the frequencies (an
outer product of two tables, contracted over nothing) gives the angles, a per-pair decay scales q up and k down. The
einsum is no attention score product: q.k is read as the block's one softmax attention (it was read as weights
written out with no softmax, and k named as a value projection). Angles kept in float32 whatever the run's dtype."""

import math

import torch
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


def xpos(t, downscale: bool, scale_base: float = 512.0):
    """t (B, H, T, d): pairs (2i, 2i + 1) turned by position x frequency, scaled by a decay ** (position / base)."""
    T, d = t.shape[-2], t.shape[-1]
    decay = (torch.arange(0, d, 2, device=t.device, dtype=torch.float32) + 0.4 * d) / (1.4 * d)
    pos = torch.arange(-(T // 2), T - T // 2, device=t.device, dtype=torch.float32)
    scale = decay ** (pos / scale_base)[:, None]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d // 2, device=t.device, dtype=torch.float32) / (d // 2)))
    angles = torch.einsum("i , j -> i j", torch.arange(T, device=t.device, dtype=torch.float32), inv_freq)
    if downscale:
        scale = 1 / scale
    sin, cos = (f.repeat_interleave(2, dim=-1) for f in (angles.sin() * scale, angles.cos() * scale))
    t1, t2 = t[..., 0::2], t[..., 1::2]
    turned = torch.stack((-t2, t1), dim=-1).flatten(-2)
    return (t.float() * cos + turned.float() * sin).to(t.dtype)


class XPosBlock(TrainBlock):
    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = xpos(q, downscale=False), xpos(k, downscale=True)
        s = (q * (1 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
        T = h.shape[1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        return self.o_proj(merge(F.dropout(s.softmax(-1), self.p, self.training) @ v))


CORRECT = ["XPosBlock"]
