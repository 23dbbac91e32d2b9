"""Blocks written for float32, correct in it, that a float64 copy cannot run (a hard-coded `.float()` meeting the
copy's float64 tensors in a matmul): the checks that work on float64 copies (`derivative`'s backward, `dtype`'s
reference forward) skip them rather than report an error. Both also refuse bfloat16, as their code says."""

import torch
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge


class _GatedDown(torch.autograd.Function):
    """w2(silu(a) * b) fused, its backward in float32 whatever the inputs (`g.float()`, as fused kernels accumulate):
    exact in float32; in float64 it meets the saved float64 weight in a matmul and raises."""

    @staticmethod
    def forward(ctx, a, b, w):
        ctx.save_for_backward(a, b, w)
        return (F.silu(a) * b) @ w.t()

    @staticmethod
    def backward(ctx, g):
        a, b, w = ctx.saved_tensors
        g32, a32, b32 = g.float(), a.float(), b.float()
        gh = g32 @ w  # (.., hidden): float32 @ the weight's dtype
        s = torch.sigmoid(a32)
        ga = gh * b32 * s * (1 + a32 * (1 - s))
        gw = g32.reshape(-1, g.shape[-1]).t() @ (F.silu(a32) * b32).reshape(-1, a.shape[-1])
        return ga.to(a.dtype), (gh * F.silu(a32)).to(b.dtype), gw.to(w.dtype)


class Float32Backward(TrainBlock):
    """The FFN's down projection through _GatedDown: a correct backward that only runs in float32."""

    def ffn(self, h):
        return self.drop(_GatedDown.apply(self.w1(h), self.w3(h), self.w2.weight))


class Float32Probabilities(TrainBlock):
    """The softmax taken in float32 and multiplied into v as it is (`probs.float() @ v`): float32 code."""

    def attention(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        T = h.shape[1]
        s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=h.device).tril(), float("-inf"))
        probs = F.dropout(s.float().softmax(-1), self.p, self.training)
        return self.o_proj(merge(probs @ v))


CORRECT = ["Float32Backward", "Float32Probabilities"]
