"""Classes and arguments named for what they compute: FFN and activation classes (SwiGLU, GeGLU, ReLUSquared), timm's
and open_clip's `act_layer`, gpt-fast's `n_local_heads` (its key/value heads): each planted bug beside a twin that does
what it says."""

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from blocks_configs import ModelArgs, TransformerBlock
from zoo_training import TrainBlock


class SwiGLU(nn.Module):
    """A gated FFN as timm and xformers name it: act(w1 x) * w3 x, then w2."""

    act = staticmethod(F.silu)

    def __init__(self, d_model, hidden, dropout):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.w2, self.drop = nn.Linear(hidden, d_model, bias=False), nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.w2(self.act(self.w1(x)) * self.w3(x)))


class GeGLU(SwiGLU):
    act = staticmethod(F.gelu)


class ClassNamedFFN(TrainBlock):
    """Correct: its FFN a module whose class name says what it computes (SwiGLU)."""

    ffn_class = SwiGLU

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w1, self.w2, self.w3
        self.mlp = self.ffn_class(d_model, int(8 * d_model / 3), dropout)

    def ffn(self, h):
        return self.mlp(h)


class GeGLUNamed(ClassNamedFFN):
    """Correct: a GeGLU FFN (lucidrains' and diffusers' GEGLU: exact gelu)."""

    ffn_class = GeGLU


class _GeluGate(SwiGLU):
    act = staticmethod(F.gelu)


_GeluGate.__name__ = "SwiGLU"


class SwiGLUComputingGelu(ClassNamedFFN):
    """A class named SwiGLU whose gate is a GELU (the activation copied from the GeGLU next to it)."""

    ffn_class = _GeluGate


class _SiluGate(SwiGLU):
    pass


_SiluGate.__name__ = "GeGLU"


class GeGLUComputingSilu(ClassNamedFFN):
    ffn_class = _SiluGate


class ReLUSquared(nn.Module):
    """Primer's squared ReLU, as Persimmon's and Nemotron's ReLUSquaredActivation; `square` False drops the square."""

    square = True

    def forward(self, x):
        return F.relu(x) ** 2 if self.square else F.relu(x)


class SquaredReLUFFN(TrainBlock):
    """Correct: Primer's FFN, relu(x)^2 through a module named for it."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3
        self.act = ReLUSquared()
        self.act.square = self.square

    square = True

    def ffn(self, h):
        return self.drop(self.w2(self.act(self.w1(h))))


class ReLUSquaredUnsquared(SquaredReLUFFN):
    """Its ReLUSquared module computes a plain ReLU."""

    square = False


class GptFastGQA(TransformerBlock):
    """Correct: gpt-fast's block with two key/value heads for four query heads (n_local_heads), interleaved."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.0, causal=True):
        super().__init__(ModelArgs(n_layer=1, n_head=n_heads, dim=d_model, n_local_heads=n_heads // 2,
                                   intermediate_size=4 * d_model))


class GptFastRepeated(GptFastGQA):
    """k and v tiled with repeat (query head h reads key head h % 2) where gpt-fast interleaves (h // 2): it trains,
    and reads every gpt-fast checkpoint wrong."""

    def grouped(self, t):
        return t.repeat(1, self.n_head // self.n_local_heads, 1, 1)


class QuickGELU(nn.Module):
    """open_clip's: x * sigmoid(1.702 x), the activation OpenAI's CLIP checkpoints were trained with."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ActLayerArgument(TrainBlock):
    """Correct: open_clip's and timm's `act_layer` argument, a class the MLP builds its activation from."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True, act_layer=QuickGELU):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.w3
        self.act = self.activation(act_layer)

    def activation(self, act_layer):
        return act_layer()

    def ffn(self, h):
        return self.drop(self.w2(self.act(self.w1(h))))


class TanhGeluPartial(ActLayerArgument):
    """Correct: timm's `partial(nn.GELU, approximate="tanh")` as the act_layer."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True,
                 act_layer=functools.partial(nn.GELU, approximate="tanh")):
        super().__init__(d_model, n_heads, dropout, causal, act_layer)


class ActLayerIgnored(ActLayerArgument):
    """Takes act_layer=QuickGELU and builds nn.GELU: OpenAI's CLIP weights under the wrong activation."""

    def activation(self, act_layer):
        return nn.GELU()


PLANTED = {"SwiGLUComputingGelu": "ffn.act", "GeGLUComputingSilu": "ffn.act", "ReLUSquaredUnsquared": "ffn.act",
           "GptFastRepeated": "attn.kv_grouping", "ActLayerIgnored": "ffn.act"}
CORRECT = ["ClassNamedFFN", "GeGLUNamed", "SquaredReLUFFN", "GptFastGQA", "ActLayerArgument", "TanhGeluPartial"]
