"""Cached decoding: decode(x_t, cache) -> (y_t, cache), x_t holding n >= 1 new tokens, cache None at the start; two
correct caches and the bugs kv_cache catches."""

import torch
import torch.nn.functional as F
from zoo_correct import LlamaBlock, RoPEBlock, heads, merge

# decode(x_t, cache) -> (y_t, cache): x_t holds n >= 1 new tokens; cache is None at the start.


class CachedLlama(LlamaBlock):
    """Llama-style, causal, with a KV cache: the cache is (k, v) of shape (B, nh, T, hs)."""

    def qkv(self, h):
        return (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))

    def extend(self, cache, k, v):
        return (k, v) if cache is None else (torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2))

    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device).tril(T - n)  # new token i sits at T - n + i

    def attend_cached(self, h, cache):
        q, k, v = self.qkv(h)
        k, v = self.extend(cache, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed(h.shape[1], k.shape[2], h.device))
        return self.o_proj(merge(y)), (k, v)

    def decode(self, x, cache=None):
        a, cache = self.attend_cached(self.attn_norm(x), cache)
        x = x + a
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), cache


class CachedRoPE(RoPEBlock):
    """RoPE with a cache: new tokens are rotated at their absolute positions (the cache length)."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)

    def rotate(self, t, start):
        T = t.shape[-2]
        pos = torch.arange(start, start + T, device=t.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.rotary.inv_freq.float())
        cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)

    def offset(self, cache):
        return 0 if cache is None else cache[0].shape[2]

    def decode(self, x, cache=None):
        h = self.attn_norm(x)
        q, k, v = (heads(p(h), self.n_heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        start = self.offset(cache)
        q, k = self.rotate(q, start), self.rotate(k, start)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        n, T = x.shape[1], k.shape[2]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, T, dtype=torch.bool, device=x.device).tril(T - n))
        x = x + self.gained("attn", self.o_proj(merge(y)))
        h = self.ffn_norm(x)
        return x + self.gained("ffn", self.down(F.silu(self.gate(h)) * self.up(h))), (k, v)

    def gained(self, branch, y):  # a branch's output as it joins the stream
        return y


class CacheWindow(CachedLlama):
    def extend(self, cache, k, v):
        k, v = super().extend(cache, k, v)
        return k[:, :, -8:], v[:, :, -8:]  # bug: a sliding window of 8 nobody asked for


class CacheKeyTwice(CachedLlama):
    def extend(self, cache, k, v):
        if cache is None:
            return k, v
        return torch.cat([cache[0], k, k], 2), torch.cat([cache[1], v, v], 2)  # bug: the new key and value appended twice

    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device).tril(T - n)


class CacheRoPEOffByOne(CachedRoPE):
    def offset(self, cache):
        return 0 if cache is None else cache[0].shape[2] - 1  # bug: positions off by one after the prefill


class CacheShared(CachedLlama):
    """Keeps its cache on the module: two sequences decoded in turns see each other's keys."""

    def decode(self, x, cache=None):
        if cache is None:
            self.store = None
        y, self.store = super().decode(x, getattr(self, "store", None))  # bug: the module's cache, not the caller's
        return y, ("token", self.store[0].shape[2])


class CacheChunkSeesFuture(CachedLlama):
    def allowed(self, n, T, device):
        return torch.ones(n, T, dtype=torch.bool, device=device)  # bug: a chunk's tokens see the chunk's later tokens


class CacheGrowsGraph(CachedLlama):
    def decode(self, x, cache=None):
        with torch.enable_grad():  # bug: builds an autograd graph across steps even under no_grad
            return super().decode(x.requires_grad_(True) if not x.requires_grad else x, cache)


class CacheForgetsPrefill(CachedLlama):
    def extend(self, cache, k, v):
        if cache is not None and cache[0].shape[2] > 1 and k.shape[2] == 1:
            cache = (cache[0][:, :, -1:], cache[1][:, :, -1:])  # bug: only the prompt's last token is kept
        return super().extend(cache, k, v)


class CachePromptByLength(CachedLlama):
    """Keeps prompts' keys and values on the module, looked up by the prompt's length (a prefix cache never keyed by
    its tokens): a second sequence with a prompt as long as an earlier one's is given that one's."""

    def extend(self, cache, k, v):
        if cache is None:
            return self.__dict__.setdefault("prompts", {}).setdefault(k.shape[2], (k, v))  # bug: keyed by length alone
        return super().extend(cache, k, v)


class CachedLayerScale(CachedRoPE):
    """Correct: CachedRoPE with LayerScale started at 1e-5 on both branches (CaiT, DINOv2): the output is the input
    to 1e-5, so a decoding error is that small too; kv_cache judges it against the block's own update."""

    def __init__(self, d_model=64, n_heads=4, causal=True):
        super().__init__(d_model, n_heads, causal)
        self.g_attn = torch.nn.Parameter(torch.full((d_model,), 1e-5))
        self.g_ffn = torch.nn.Parameter(torch.full((d_model,), 1e-5))

    def forward(self, x, pad_mask=None):
        x = x + self.gained("attn", self.attention(self.attn_norm(x), pad_mask))
        h = self.ffn_norm(x)
        return x + self.gained("ffn", self.down(F.silu(self.gate(h)) * self.up(h)))

    def gained(self, branch, y):
        return getattr(self, f"g_{branch}") * y


class LayerScaleCacheForgetsPrefill(CachedLayerScale):
    """The cache keeps only the prompt's last token (CacheForgetsPrefill's bug): 4e-6 of the output, under float32's
    tolerance, yet more than the whole update the block adds there."""

    def decode(self, x, cache=None):
        if cache is not None and cache[0].shape[2] > 1 and x.shape[1] == 1:
            cache = (cache[0][:, :, -1:], cache[1][:, :, -1:])  # bug
        return super().decode(x, cache)
