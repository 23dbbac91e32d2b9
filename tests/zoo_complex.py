"""A Llama-3 block as Meta's reference and torchtitan write it: rotary angles as a complex `freqs_cis` buffer (which
`Module.to(float32)` would turn real, dropping the sines), a ModelArgs dataclass kept as `self.args`, grouped
key/value heads through repeat_kv, the SwiGLU width by the 2/3 rule. Correct, and a twin that computes its table
with the default base while its args say 500000; the table kept as a plain attribute, moved to the input's device at
each call (Meta's reference), and left where it was built."""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_meta import RMSNorm


@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 512
    multiple_of: int = 32


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis[None, :, None, :]
    xq_out = torch.view_as_real(xq_ * fc).flatten(3)
    xk_out = torch.view_as_real(xk_ * fc).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_kv_heads
        self.n_heads = args.n_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ComplexRotaryBlock(nn.Module):
    theta_from_args = True

    def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
        super().__init__()
        args = ModelArgs(dim=d_model, n_heads=n_heads, n_kv_heads=max(1, n_heads // 2))
        self.args = args
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        theta = args.rope_theta if self.theta_from_args else 10000.0
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.attention.head_dim, args.max_seq_len, theta), persistent=False)

    def forward(self, x):
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        h = x + self.attention(self.attention_norm(x), self.freqs_cis[:T], mask)
        return h + self.feed_forward(self.ffn_norm(h))


class ComplexRotaryThetaDefaulted(ComplexRotaryBlock):
    theta_from_args = False  # bug: precompute_freqs_cis called without the args' rope_theta


class PlainTableFollowed(ComplexRotaryBlock):
    """Meta's reference keeps freqs_cis as a plain attribute and moves it to the input's device at every call: not
    saved and not moved by .to(), yet it follows the block wherever it runs (twin)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        table = self.freqs_cis
        del self.freqs_cis
        self.freqs_cis = table

    def table(self, x):
        self.freqs_cis = self.freqs_cis.to(x.device)
        return self.freqs_cis

    def forward(self, x):
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        h = x + self.attention(self.attention_norm(x), self.table(x)[:T], mask)
        return h + self.feed_forward(self.ffn_norm(h))


class PlainTableLeft(PlainTableFollowed):
    def table(self, x):
        return self.freqs_cis  # bug: a plain attribute .to() does not move: on a GPU the forward mixes devices


class PlainTableUnderAutocast(PlainTableFollowed):
    """OLMo's rotary cache: a plain dict's table moved to the input's device inside `torch.autocast(x.device.type,
    enabled=False)`, so it stays float32 under any autocast (twin): it follows the block as Meta's does."""

    def table(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return super().table(x)


CORRECT = ["ComplexRotaryBlock", "PlainTableFollowed", "PlainTableUnderAutocast"]
PLANTED = {"ComplexRotaryThetaDefaulted": "spec", "PlainTableLeft": "state_dict"}
