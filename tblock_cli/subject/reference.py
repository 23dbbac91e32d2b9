"""PyTorch's own nn.TransformerEncoderLayer, built to match the built-in block, as an independent truth."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.config import BlockConfig
from tblock_cli.subject.builtin import Block, Stack, causal_mask


def encoder_layer(cfg: BlockConfig, norm: str) -> nn.TransformerEncoderLayer:
    """An nn.TransformerEncoderLayer of the same shape: norm_first for Pre-LN, same activation and eps."""
    return nn.TransformerEncoderLayer(
        cfg.d_model, cfg.n_heads, dim_feedforward=cfg.ffn_dim, dropout=cfg.dropout, activation=cfg.activation,
        layer_norm_eps=cfg.eps, batch_first=True, norm_first=(norm == "pre"), bias=cfg.bias,
    )


def copy_weights(block: Block, layer: nn.TransformerEncoderLayer) -> nn.TransformerEncoderLayer:
    """Load the block's weights into the encoder layer under its names."""
    pairs = {"self_attn": block.attn, "linear1": block.ffn.fc1, "linear2": block.ffn.fc2, "norm1": block.ln1, "norm2": block.ln2}
    for name, src in pairs.items():
        getattr(layer, name).load_state_dict(src.state_dict())
    return layer


def reference_output(module: nn.Module, cfg: BlockConfig, x: torch.Tensor) -> torch.Tensor:
    """The built-in block's (or stack's) output recomputed with nn.TransformerEncoderLayer copies."""
    blocks = list(module.layers) if isinstance(module, Stack) else [module]
    mask = causal_mask(x.shape[1], x.device) if cfg.causal else None
    for block in blocks:
        layer = copy_weights(block, encoder_layer(cfg, block.norm)).to(device=x.device, dtype=x.dtype).eval()
        x = layer(x, src_mask=mask, is_causal=cfg.causal)
    if isinstance(module, Stack) and module.final_ln is not None:
        x = module.final_ln(x)
    return x
