"""A correct block whose finite differences mislead at every coarse step: `x * scale + EPS * sin(x / EPS)` wiggles with
a period far below the derivative check's steps (1e-2 .. 1e-3), so those differences average the wiggle away and agree
with each other on a slope autograd does not give, while a step far below the period reads autograd's. ReLU blocks do
this where kinks lie near the point at every scale (nn.TransformerEncoderLayer at seq 64 on torch 2.4.1)."""

import torch
import torch.nn as nn

EPS = 2e-5


class Wiggle(nn.Module):
    def __init__(self, d_model: int = 32, **_):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * self.scale + EPS * torch.sin(x / EPS)
