"""Correct designs of popular libraries (written after x-transformers' options) that earlier versions raised alarms
on: cosine attention (q and k L2-normalised, the scores times a temperature of 10, a `scale` of 1/sqrt(d_head) kept
unused), ScaleNorm (one scalar gain, so no parameter says the width it normalises), a position bias computed by an MLP
over distances (a chain of projections that reads no tensor of the stream's width), learned memory keys and values
concatenated to k and v (parameters of the attention module that are no projection), and talking heads (a learned
map over heads before the softmax, whose score scale cannot be read as one multiple of each head's q.k; or, started as
the identity added to the scores, moves with the map's weights), and CaiT's layer (talking heads with a bias before the
softmax, whose gradient is rounding, and LayerScale modules at 1e-5), and Locality Self-Attention (each token's own
score masked in bidirectional scores), linear attention (no token x token matrix), and hyper-connections (products
of activations over a streams axis), sigmoid attention (weights in [0, 1] that no softmax normalises), a gain per channel on the stream (NormFormer's,
trained), Stable Diffusion's cross-attention over a context (keys and values that read no stream) and DiT's class
conditioning (adaLN over a label that classifier-free guidance drops in training), rotary tables computed in the forward
with no name saying so. Each is
`TrainBlock` of tests/zoo_training.py with one thing changed; constructors take tblock's keywords."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from zoo_training import TrainBlock, heads, merge

# F.normalize's default eps, 1e-12, is 0 in float16: a zero token would give 0/0 (the `finite` check's zero input)
EPS = 1e-6


def causal_softmax(s):
    T = s.shape[-1]
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf")).softmax(-1)


class ModuleAttentionBlock(TrainBlock):
    """TrainBlock with its attention replaced by a module of `attention_class`, built at (d_model, n_heads)."""

    attention_class: type

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj
        self.attn = self.attention_class(d_model, n_heads)

    def attention(self, h):
        return self.attn(h)


class CosineAttention(nn.Module):
    """q and k L2-normalised per head, their product times a fixed temperature (x-transformers' attn_qk_norm with
    qk_norm_scale 10, Swin v2): `scale` holds 1/sqrt(d_head), as the module keeps it for its other mode, unused."""

    def __init__(self, d_model, n_heads, temperature=10.0):
        super().__init__()
        self.n_heads, self.temperature = n_heads, temperature
        self.scale = (d_model // n_heads) ** -0.5
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        q, k = F.normalize(q, dim=-1, eps=EPS), F.normalize(k, dim=-1, eps=EPS)
        return self.to_out(merge(causal_softmax((q @ k.transpose(-2, -1)) * self.temperature) @ v))


class CosineAttentionBlock(ModuleAttentionBlock):
    attention_class = CosineAttention


class ScaleNorm(nn.Module):
    """x / |x| * sqrt(d) * (1 + g), g one scalar initialised to 0 (x-transformers' ScaleNorm with a unit offset)."""

    def __init__(self, d_model):
        super().__init__()
        self.scale = d_model**0.5
        self.g = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=EPS) * self.scale * (self.g + 1)


class ScaleNormBlock(TrainBlock):
    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.attn_norm, self.ffn_norm = ScaleNorm(d_model), ScaleNorm(d_model)


class DistanceBiasBlock(TrainBlock):
    """A bias per head computed by an MLP over the distance j - i (x-transformers' dynamic position bias), added to
    causal scores: Linear(1, d/4) -> SiLU -> Linear(d/4, d/4) -> SiLU -> Linear(d/4, heads) over log distances."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        w = d_model // 4
        self.bias_mlp = nn.Sequential(nn.Linear(1, w), nn.SiLU(), nn.Linear(w, w), nn.SiLU(), nn.Linear(w, n_heads))

    def attention(self, h):
        T = h.shape[1]
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        pos = torch.arange(T, device=h.device)  # integers: exact at any length, whatever the block's dtype
        rel = (pos[None, :] - pos[:, None]).float()
        rel = (rel.sign() * rel.abs().log1p()).to(h.dtype)  # log distances (x-transformers' log_distance): bounded
        bias = self.bias_mlp(rel[..., None]).permute(2, 0, 1)  # (heads, T, T)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + bias
        return self.o_proj(merge(causal_softmax(s) @ v))


class MemoryAttention(nn.Module):
    """Learned memory keys and values (x-transformers' attn_num_mem_kv), concatenated before the sequence's: every
    query may attend to them, causality kept among the tokens."""

    def __init__(self, d_model, n_heads, memories=4):
        super().__init__()
        self.n_heads = n_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.mem_k = nn.Parameter(torch.randn(n_heads, memories, d_model // n_heads))
        self.mem_v = nn.Parameter(torch.randn(n_heads, memories, d_model // n_heads))

    def forward(self, h):
        B, T, _ = h.shape
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        M = self.mem_k.shape[1]
        k = torch.cat((self.mem_k.expand(B, -1, -1, -1), k), dim=2)
        v = torch.cat((self.mem_v.expand(B, -1, -1, -1), v), dim=2)
        allowed = torch.cat((torch.ones(T, M, dtype=torch.bool, device=h.device),
                             torch.ones(T, T, dtype=torch.bool, device=h.device).tril()), dim=1)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return self.to_out(merge(s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v))


class MemoryKVBlock(ModuleAttentionBlock):
    attention_class = MemoryAttention


class TalkingHeadsAttention(nn.Module):
    """Talking heads (Shazeer et al. 2020): a learned heads x heads map over the scores before the softmax, randomly
    initialised; `scale` 1/sqrt(d_head) applied before it."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.scale = n_heads, (d_model // n_heads) ** -0.5
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.mix = nn.Parameter(torch.eye(n_heads) + 0.5 * torch.randn(n_heads, n_heads) / math.sqrt(n_heads))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = torch.einsum("gh,bhij->bgij", self.mix, (q @ k.transpose(-2, -1)) * self.scale)
        return self.to_out(merge(causal_softmax(s) @ v))


class TalkingHeadsBlock(ModuleAttentionBlock):
    attention_class = TalkingHeadsAttention


class AddedTalkingHeads(TalkingHeadsAttention):
    """x-transformers' talking heads: the map added to the scores (`sim + conv(sim)`) and initialised as the identity,
    so the logits start at twice the `scale` the module keeps, with no mixing between heads until it trains."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.mix = nn.Parameter(torch.eye(n_heads))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = (q @ k.transpose(-2, -1)) * self.scale
        s = s + torch.einsum("gh,bhij->bgij", self.mix, s)
        return self.to_out(merge(causal_softmax(s) @ v))


class AddedTalkingHeadsBlock(ModuleAttentionBlock):
    attention_class = AddedTalkingHeads


class LayerScale(nn.Module):
    """timm's LayerScale: x * gamma, gamma a constant `init` per channel at build (1e-5 in CaiT and DeiT-3)."""

    def __init__(self, d_model, init=1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init * torch.ones(d_model))

    def forward(self, x):
        return x * self.gamma


class CaiTAttention(TalkingHeadsAttention):
    """timm's CaiT talking heads: heads x heads linear maps with biases, one on the logits (proj_l, before the softmax:
    its bias adds a constant to every logit of a row, so its gradient is rounding) and one on the probabilities."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.mix
        self.proj_l, self.proj_w = nn.Linear(n_heads, n_heads), nn.Linear(n_heads, n_heads)

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = self.proj_l(((q * self.scale) @ k.transpose(-2, -1)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        w = self.proj_w(causal_softmax(s).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        T = w.shape[-1]  # CaiT attends both ways; here causal: proj_w's bias would reach the future, so it is cut again
        return self.to_out(merge(w.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=w.device).tril(), 0.0) @ v))


class CaiTBlock(ModuleAttentionBlock):
    """CaiT's layer: its talking heads, and each branch through a LayerScale module at 1e-5 (so at build both add
    1e-5 of their output: a module with one 1-D parameter of the stream's width that is no norm)."""

    attention_class = CaiTAttention

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.ls1, self.ls2 = LayerScale(d_model), LayerScale(d_model)

    def forward(self, x):
        x = x + self.ls1(self.drop(self.attention(self.attn_norm(x))))
        return x + self.ls2(self.ffn(self.ffn_norm(x)))


class LocalitySelfAttention(TalkingHeadsAttention):
    """Locality Self-Attention (Lee et al. 2021, vit-pytorch's vit_for_small_dataset): bidirectional scores with each
    token's own masked on purpose, and a learned temperature started at 1/sqrt(d_head)."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.mix
        self.temperature = nn.Parameter(torch.log(torch.tensor(self.scale)))

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        s = (q @ k.transpose(-2, -1)) * self.temperature.exp()
        T = s.shape[-1]
        s = s.masked_fill(torch.eye(T, dtype=torch.bool, device=s.device), -torch.finfo(s.dtype).max)
        return self.to_out(merge(s.softmax(-1) @ v))


class LocalitySelfAttentionBlock(ModuleAttentionBlock):
    attention_class = LocalitySelfAttention

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal=False)  # bidirectional by design


class LinearAttention(TalkingHeadsAttention):
    """Linear attention (Katharopoulos et al. 2020): phi(q) (phi(k)^T v) / (phi(q) . sum phi(k)), phi = elu + 1, with
    no token x token matrix at all (k^T v is heads x d x d); causal blocks are out of its scope, so it is bidirectional."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.mix

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        z = 1 / (q @ k.sum(-2, keepdim=True).transpose(-2, -1))
        return self.to_out(merge((q @ (k.transpose(-2, -1) @ v)) * z))


class LinearAttentionBlock(ModuleAttentionBlock):
    attention_class = LinearAttention

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal=False)


class SigmoidAttention(TalkingHeadsAttention):
    """Sigmoid attention (Ramapuram et al. 2024): each key's weight sigmoid(q.k / sqrt(d) + b), b = -log n for the
    training context n (a constant: 64 here), no normalisation over the keys (weights in [0, 1], rows not summing to
    1), the future's weights zeroed."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.mix

    def forward(self, h):
        q, k, v = (heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
        T = q.shape[-2]
        w = torch.sigmoid((q @ k.transpose(-2, -1)) * self.scale - math.log(64))
        return self.to_out(merge(w.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=w.device).tril(), 0.0) @ v))


class SigmoidAttentionBlock(ModuleAttentionBlock):
    attention_class = SigmoidAttention


class StreamGainBlock(TrainBlock):
    """NormFormer's residual scaling, as trained: the stream multiplied by a gain per channel (1 + 0.3 N(0, 1)) at
    each add. A linear identity path, though no one multiple of the input."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.resid_gain = nn.Parameter(1 + 0.3 * torch.randn(d_model))

    def forward(self, x):
        x = x * self.resid_gain + self.drop(self.attention(self.attn_norm(x)))
        return x * self.resid_gain + self.ffn(self.ffn_norm(x))


class HyperConnectionsBlock(TrainBlock):
    """Hyper-connections (Zhu et al. 2024, as vit-pytorch writes them): the stream widened to `streams` copies; before
    each branch a learned mix over the copies (static, plus a tanh of the normed copies) makes the branch's input
    and the copies kept, and the branch's output is added to each copy with its own weight. The mixes are products of
    two activations over the streams axis, not over tokens: no attention."""

    streams = 2

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        e = self.streams
        self.hc_norm = nn.ModuleList(nn.LayerNorm(d_model, bias=False) for _ in range(2))
        self.static_alpha = nn.ParameterList(nn.Parameter(torch.cat([torch.eye(e)[:, :1], torch.eye(e)], 1))
                                             for _ in range(2))
        self.dynamic_alpha = nn.ParameterList(nn.Parameter(0.02 * torch.randn(d_model, e + 1)) for _ in range(2))
        self.static_beta = nn.ParameterList(nn.Parameter(torch.ones(e)) for _ in range(2))

    def around(self, i, x, branch):
        alpha = (self.hc_norm[i](x) @ self.dynamic_alpha[i]).tanh() * 0.01 + self.static_alpha[i]  # (B, T, e, e + 1)
        mixed = torch.einsum("btef,bted->btfd", alpha, x)
        return torch.einsum("btd,e->bted", branch(mixed[:, :, 0]), self.static_beta[i]) + mixed[:, :, 1:]

    def forward(self, x):
        x = x.unsqueeze(2).expand(-1, -1, self.streams, -1)
        x = self.around(0, x, lambda h: self.drop(self.attention(self.attn_norm(h))))
        x = self.around(1, x, lambda h: self.ffn(self.ffn_norm(h)))
        return x.mean(2)  # a model sums the copies once, after its last layer (then a norm); one block averages them


class CrossAttentionBlock(TrainBlock):
    """Stable Diffusion's transformer block (diffusers' BasicTransformerBlock): self-attention, then cross-attention
    whose keys and values read a context (here learned, 6 tokens of width d/2) and no norm, then the FFN. The
    cross-attention's keys and values read no residual stream: no norm is missing before them."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.context = nn.Parameter(torch.randn(6, d_model // 2))
        self.cross_norm = nn.LayerNorm(d_model)
        self.cross_q, self.cross_o = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.cross_k, self.cross_v = (nn.Linear(d_model // 2, d_model, bias=False) for _ in range(2))

    def cross(self, h):
        ctx = self.context.expand(h.shape[0], -1, -1)
        q, k, v = heads(self.cross_q(h), self.n_heads), heads(self.cross_k(ctx), self.n_heads), heads(self.cross_v(ctx), self.n_heads)
        return self.cross_o(merge(F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)))

    def forward(self, x):
        x = x + self.drop(self.attention(self.attn_norm(x)))
        x = x + self.drop(self.cross(self.cross_norm(x)))
        return x + self.ffn(self.ffn_norm(x))


class LabelEmbedding(nn.Module):
    """DiT's class embedding: in training each label is replaced by a learned null class with probability
    class_dropout_prob, so that the model learns the unconditional prediction classifier-free guidance needs."""

    def __init__(self, classes, d_model, class_dropout_prob=0.1):
        super().__init__()
        self.classes, self.class_dropout_prob = classes, class_dropout_prob
        self.table = nn.Embedding(classes + 1, d_model)

    def forward(self, labels):
        if self.training and self.class_dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device) < self.class_dropout_prob
            labels = torch.where(drop, self.classes, labels)
        return self.table(labels)


class ClassConditionedBlock(TrainBlock):
    """DiT's adaLN conditioning at one fixed class: the class embedding (null class in training at 10 %) through SiLU
    and a linear map gives a shift, a scale and a gate per sublayer. The modulation reads a constant, no stream."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=True):
        super().__init__(d_model, n_heads, dropout, causal)
        self.label = LabelEmbedding(2, d_model)
        self.modulation = nn.Linear(d_model, 6 * d_model)
        nn.init.normal_(self.modulation.weight, std=0.02)

    def forward(self, x):
        c = self.label(torch.full(x.shape[:1], 1, dtype=torch.long, device=x.device))
        s1, b1, g1, s2, b2, g2 = self.modulation(F.silu(c))[:, None].chunk(6, -1)
        x = x + g1 * self.drop(self.attention(self.attn_norm(x) * (1 + s1) + b1))
        return x + g2 * self.ffn(self.ffn_norm(x) * (1 + s2) + b2)


class TablesInForwardBlock(TrainBlock):
    """Rotary tables computed in the forward from the head width alone, as diffusers' blocks get them from their model:
    no module, buffer or parameter is named for positions (bidirectional: token order matters by design)."""

    def __init__(self, d_model=64, n_heads=4, dropout=0.1, causal=False):
        super().__init__(d_model, n_heads, dropout, causal)
        del self.rotary

    def rotary(self, t):
        half = torch.arange(t.shape[-1] // 2, device=t.device, dtype=torch.float32) * 2 / t.shape[-1]
        a = torch.outer(torch.arange(t.shape[-2], device=t.device, dtype=torch.float32), 10000.0 ** -half)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack([t1 * a.cos() - t2 * a.sin(), t1 * a.sin() + t2 * a.cos()], -1).flatten(-2).to(t.dtype)


CORRECT = ["CosineAttentionBlock", "ScaleNormBlock", "DistanceBiasBlock", "MemoryKVBlock", "TalkingHeadsBlock",
           "AddedTalkingHeadsBlock", "CaiTBlock", "LocalitySelfAttentionBlock", "LinearAttentionBlock",
           "SigmoidAttentionBlock", "StreamGainBlock", "CrossAttentionBlock", "ClassConditionedBlock",
           "TablesInForwardBlock"]
# bidirectional by design: checked without --causal (the others with it)
BIDIRECTIONAL = ["LocalitySelfAttentionBlock", "LinearAttentionBlock", "TablesInForwardBlock"]
