"""The built-in Transformer block (Pre- or Post-LN) and stacks of it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tblock_cli.config import BlockConfig


def causal_mask(T: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True above the diagonal: position t may not attend to t' > t."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


class FeedForward(nn.Module):
    """Linear(d, d_ff) -> activation -> Linear(d_ff, d) -> Dropout."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """One Transformer block: Pre-LN `x + f(LN(x))` or Post-LN `LN(x + f(x))`."""

    def __init__(self, cfg: BlockConfig, norm: str | None = None):
        super().__init__()
        self.norm = norm or cfg.norm
        self.causal = cfg.causal
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias)
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, dropout=cfg.dropout, bias=cfg.bias, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias)
        self.ffn = FeedForward(cfg)

    def _sa(self, h: torch.Tensor, pad_mask: torch.Tensor | None) -> torch.Tensor:
        mask = causal_mask(h.shape[1], h.device) if self.causal else None
        return self.attn(h, h, h, key_padding_mask=pad_mask, attn_mask=mask, need_weights=False)[0]

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: (B, T, C); pad_mask: (B, T), True = padding
        if self.norm == "pre":
            x = x + self._sa(self.ln1(x), pad_mask)
            x = x + self.ffn(self.ln2(x))
        else:
            x = self.ln1(x + self._sa(x, pad_mask))
            x = self.ln2(x + self.ffn(x))
        return x

    def _sa_cached(self, h: torch.Tensor, cache: tuple | None) -> tuple[torch.Tensor, tuple]:
        """Causal self-attention of n new tokens over the cached keys and values, with the same weights as _sa."""
        B, n, C = h.shape
        H = self.attn.num_heads
        q, k, v = F.linear(h, self.attn.in_proj_weight, self.attn.in_proj_bias).split(C, dim=-1)
        q, k, v = (t.view(B, n, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, nh, n, hs)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)  # (B, nh, T, hs)
        T = k.shape[2]
        allowed = torch.ones(n, T, dtype=torch.bool, device=h.device).tril(T - n)  # new token i sits at T - n + i
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.attn.out_proj(y.transpose(1, 2).reshape(B, n, C)), (k, v)

    def decode(self, x: torch.Tensor, cache: tuple | None = None) -> tuple[torch.Tensor, tuple]:
        """Incremental causal decoding: x (B, n, C) new tokens -> their outputs and the grown (k, v) cache.

        Prefill is one call with the whole prompt; then one call per generated token. Equals forward()
        of the whole sequence at every position (tblock check --causal verifies it: kv_cache).
        """
        if not self.causal:
            raise ValueError("decode needs a causal block (--causal): a bidirectional block's outputs change as tokens arrive")
        if self.norm == "pre":
            a, cache = self._sa_cached(self.ln1(x), cache)
            x = x + a
            return x + self.ffn(self.ln2(x)), cache
        a, cache = self._sa_cached(x, cache)
        x = self.ln1(x + a)
        return self.ln2(x + self.ffn(x)), cache


def layer_norms(cfg: BlockConfig) -> list[str]:
    """Norm placement of each layer: all `cfg.norm`, or pre/post alternating for 'mixed'."""
    if cfg.norm == "mixed":
        return ["pre" if i % 2 == 0 else "post" for i in range(cfg.layers)]
    return [cfg.norm] * cfg.layers


def is_stack(cfg: BlockConfig) -> bool:
    return cfg.layers > 1 or cfg.norm == "mixed"


def has_final_norm(cfg: BlockConfig) -> bool:
    """A stack ends with a LayerNorm when its last layer is Pre-LN (that output is not normalised)."""
    return is_stack(cfg) and cfg.final_norm and layer_norms(cfg)[-1] == "pre"


class Stack(nn.Module):
    """N blocks; a final LayerNorm when the last block is Pre-LN (its output is not normalised)."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, norm) for norm in layer_norms(cfg))
        self.final_ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps, bias=cfg.bias) if has_final_norm(cfg) else None

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, pad_mask)
        return self.final_ln(x) if self.final_ln is not None else x

    def decode(self, x: torch.Tensor, cache: list | None = None) -> tuple[torch.Tensor, list]:
        """Incremental decoding through every layer; the cache is one (k, v) per layer."""
        cache = cache if cache is not None else [None] * len(self.layers)
        new = []
        for layer, c in zip(self.layers, cache):
            x, c = layer.decode(x, c)
            new.append(c)
        return (self.final_ln(x) if self.final_ln is not None else x), new


def build_block(cfg: BlockConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A Block for one layer, a Stack for several, initialised from cfg.seed.

    Built on the CPU and moved, so a seed gives the same weights on every device; the meta device
    (shapes without storage, for counting) is built in place.
    """
    torch.manual_seed(cfg.seed)
    kind = Stack if is_stack(cfg) else Block
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return kind(cfg).to(dtype=dtype)
    return kind(cfg).to(device=device, dtype=dtype)
