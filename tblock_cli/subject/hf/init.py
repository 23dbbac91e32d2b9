"""Building a Hugging Face model initialised once: transformers' own `_init_weights` runs, torch's layer
constructors' defaults (which it overwrites) do not.

`AutoModel.from_config` runs every `nn.Linear`'s kaiming init and then the model's `_init_weights`, which
draws every matrix again: at a 7B-size layer the first pass is ~200M random draws thrown away. Here torch's
init functions only mark tensors (NaN) while the model is constructed; transformers' init, which calls the
original functions, writes them. A tensor still marked afterwards (one the model's init leaves to torch's
defaults) makes the build start over the ordinary way, so every model gets the weights it always got.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn as nn


@contextmanager
def _torch_init_marks():
    try:
        from transformers.initialization import TORCH_INIT_FUNCTIONS, TORCH_MODULES_TO_PATCH
    except ImportError:  # transformers 4.x keeps no such table: the model is built the ordinary way, initialised twice
        yield
        return

    def mark(tensor, *_args, **_kwargs):
        with torch.no_grad():
            return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    saved = []
    try:
        for module_name in TORCH_MODULES_TO_PATCH:
            module = sys.modules.get(module_name)
            for name in TORCH_INIT_FUNCTIONS if module is not None else ():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, mark)
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _marked(model: nn.Module) -> bool:
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta]  # a meta build holds no values
    return any(t.is_floating_point() and t.numel() and torch.isnan(t.sum()) for t in tensors)


def from_config_once(auto_class, config) -> nn.Module:
    """auto_class.from_config(config) with one initialisation pass (see the module's docstring)."""
    state = torch.random.get_rng_state()
    with _torch_init_marks():
        model = auto_class.from_config(config)
    if not _marked(model):
        return model
    del model
    torch.random.set_rng_state(state)
    return auto_class.from_config(config)
