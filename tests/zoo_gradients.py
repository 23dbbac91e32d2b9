"""Planted bugs the gradient checks catch: no residual, a residual counted twice or taken after the norm, parameters or
inputs the gradient never reaches."""

import torch
import torch.nn as nn
from zoo_correct import Good


class NoResidual(Good):
    def forward(self, x, pad_mask=None):
        x = self.sa(self.ln1(x), pad_mask)  # bug: the attention residual is gone
        return x + self.ffn(self.ln2(x))


class NoFFNResidual(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return self.ffn(self.ln2(x))  # bug: the FFN residual is gone


class UnusedLayer(Good):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.proj = nn.Linear(self.ln1.normalized_shape[0], self.ln1.normalized_shape[0])  # bug: never called


class FrozenBranch(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        with torch.no_grad():  # bug: the FFN never trains
            h = self.ffn(self.ln2(x))
        return x + h


class DetachedInput(Good):
    def forward(self, x, pad_mask=None):
        return super().forward(x.detach(), pad_mask)  # bug: no gradient reaches the caller


class NoGradParams(Good):
    def forward(self, x, pad_mask=None):
        x = x + self.sa(self.ln1(x), pad_mask)
        return x + self.ffn(self.ln2(x)).detach()  # bug: the FFN's gradient is cut


class ResidualTwice(Good):
    def forward(self, x, pad_mask=None):
        x = x + x + self.sa(self.ln1(x), pad_mask)  # bug: the identity counted twice
        return x + self.ffn(self.ln2(x))


class ResidualFromNorm(Good):
    def forward(self, x, pad_mask=None):
        h = self.ln1(x)
        x = h + self.sa(h, pad_mask)  # bug: the residual adds LN(x), not x
        return x + self.ffn(self.ln2(x))
