"""Rotary tables built for one pairing convention and read with another: what `spec` reads of the frequency each
pair turns at, held against the base the rotary module says it has."""

import torch
from zoo_training import Rotary, TrainBlock


class CatTableRotary(Rotary):
    """HF's (T, dim) table, cat(freqs, freqs) for rotate_half, read with Meta's interleaved pairs at its even columns:
    pair i turns at frequency 2i mod dim/2, so half the frequencies turn twice and the slow half never."""

    def forward(self, t):
        freqs = self.angles(t.shape[-2], t.device)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(t.dtype)[..., 0::2], emb.sin().to(t.dtype)[..., 0::2]
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class CatTableInterleaved(TrainBlock):
    """The table above in a block whose rotary module says base 1e4 (its `base`): the twin is TrainBlock itself."""

    rotary_class = CatTableRotary
