"""The built-in Transformer block (Pre- or Post-LN) and stacks of it."""

from __future__ import annotations

import torch
import torch.nn as nn

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
