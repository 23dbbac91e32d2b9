"""A layer driven through its own model's forward (--layer N) where the model checkpoints its layers itself: the
backward's recompute must see the hidden states tblock handed the layer."""

from __future__ import annotations

import functools

import pytest
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tblock_cli import api

SIZES = dict(d_model=32, n_heads=4, d_ff=64, seq=8, threads=1)


class CheckpointedLoop(nn.Module):
    """A model over token ids whose loop checkpoints each layer's `__call__` through its own function, as transformers
    4.x and 5.1x do: the hooks that hand tblock's hidden states to the driven layer run inside the checkpoint."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64, dropout=0.0, vocab=50, n_layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, batch_first=True,
                                                               norm_first=True) for _ in range(n_layers))
        self.gradient_checkpointing = False

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = self._gradient_checkpointing_func(layer.__call__, h)
            else:
                h = layer(h)
        return h


class ReentrantCheckpointedLoop(CheckpointedLoop):
    """The same loop with its own reentrant checkpoint (transformers 4.x's default): the layer runs inside it without
    grad, so the output a hook sees there carries no graph; the forward must stop with the checkpoint's output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)


@pytest.mark.parametrize("model", [CheckpointedLoop, ReentrantCheckpointedLoop])
def test_a_model_that_checkpoints_its_layers_call_recomputes_the_driven_layer_on_its_own_input(model):
    """The model's own checkpoint function runs the layer's hooks inside the checkpoint: the backward's recompute
    comes after tblock's hooks are gone, so the checkpoint must hold tblock's hidden states, not the model's placeholder
    (on the placeholder the recompute computes another function: transformers 5.17's layers failed so), and the
    forward must stop with what the checkpoint returns (transformers 4.46's reentrant one: every gradient None)."""
    r = api.check(model, layer=0, only="checkpointing", dropout=0.1, **SIZES)
    (c,) = r.checks
    assert c.status.value == "pass", c.detail
    assert c.facts["switches"] == ["gradient_checkpointing = True"]

