"""The seed article's own self-check of its Pre-LN block, at tblock check's defaults (d_model 512, 8 heads,
d_ff 2048, batch 2, seq 10): shape kept, finite outputs, a gradient reaching the input, eval deterministic.
The yardstick `tblock check` at its defaults is measured against (scripts/perf_pairs.py)."""

import torch
import torch.nn as nn

torch.set_num_threads(1)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d=512, h=8, d_ff=2048, dropout=0.1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=dropout, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Linear(d_ff, d), nn.Dropout(dropout))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


block = Block()
x = torch.randn(2, 10, 512, requires_grad=True)
out = block(x)
assert out.shape == x.shape
assert torch.isfinite(out).all()
out.sum().backward()
assert x.grad is not None and x.grad.abs().sum() > 0
block.eval()
with torch.no_grad():
    assert torch.equal(block(x), block(x))
print("ok")
