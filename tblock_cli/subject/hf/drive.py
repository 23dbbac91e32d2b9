"""The model's own forward drives its layers: tblock's hidden states go in at the first layer, and come out of the last.

The model (or its encoder or decoder stack) runs on placeholder `inputs_embeds` with the 2-D mask and cache a probe
needs; a pre-hook on the first layer swaps the placeholder for tblock's x, a hook on the last layer stops the forward
with its output. Masks, rotary and ALiBi positions, relative position biases, layer types and caches are all the
model's own business: every argument a layer gets is the one its model gives it.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.subject.through import drive


def accepted(fn, kwargs: dict) -> dict:
    """The keywords fn takes (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


class HFLayers(nn.Module):
    """Layers first..last of a model, called through the model's forward; (B, T, d) in and out.

    attention_mask: (B, T), 1 = keep (HF's convention); the model turns it into its own mask. Only the layers are
    this module's parameters: the embeddings and final norm the forward also passes through are not the block's.
    """

    def __init__(self, model_type: str, config, stack: nn.Module, all_layers: nn.ModuleList, span: tuple[int, int],
                 memory: torch.Tensor | None = None):
        super().__init__()
        self.model_type, self.config = model_type, config
        self.layers = nn.ModuleList(all_layers[span[0] : span[1] + 1])
        # Kept out of the parameter registry (plain attributes), carried by deepcopy, moved by _apply below.
        self.__dict__["_stack"], self.__dict__["_all"] = stack, all_layers
        self.span = span
        self.memory = memory  # a decoder stack's encoder output, (1, S, d): the same for every sample
        self.output_attentions = False  # HF's need_weights; bench --need-weights forces it
        params = inspect.signature(stack.forward).parameters
        self.entry = "inputs_embeds" if "inputs_embeds" in params else "hidden_states"
        self.cache_name = next((n for n in ("cache", "past_key_values") if n in params), None)
        # a padding mask where the model takes tokens (inputs_embeds); vision encoders' attention_mask is no such mask
        self.pads = self.entry == "inputs_embeds" and "attention_mask" in params
        self.causal = False  # set by build from what the model does
        self.positional = False
        self.by_design: dict[str, str] = {}
        self.warnings: tuple[str, ...] = ()

    @property
    def pad_keyword(self) -> str | None:
        return "attention_mask" if self.pads else None

    def _apply(self, fn, recurse=True):
        self._stack._apply(fn, recurse)  # rotary buffers, position biases and embeddings move with the layers
        super()._apply(fn, recurse)
        if any(p.dtype == torch.float64 for p in self.layers.parameters()):
            # grouped_mm has no float64; the eager experts loop computes the same function
            self.config._experts_implementation = "eager"
        return self

    def train(self, mode: bool = True):
        self._stack.train(mode)
        return super().train(mode)

    @contextmanager
    def attentions(self, on: bool):
        """HF's need_weights: output_attentions, computed by the eager implementation (sdpa returns no weights,
        as transformers warns), so 'on' is what asking a model for its attentions costs."""
        was = (self.output_attentions, self.config._attn_implementation)
        self.output_attentions = on
        if on:
            self.config._attn_implementation = "eager"
        try:
            yield
        finally:
            self.output_attentions, self.config._attn_implementation = was

    def run(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None, use_cache: bool = False):
        """Layers first..last on x through the model's forward; (output, the cache the layers were given)."""
        seen = {}

        def entered(args, kwargs):
            seen["cache"] = next((v for v in list(kwargs.values()) + list(args[1:]) if _is_cache(v)), None)

        B, T, _ = x.shape
        placeholder = torch.zeros(B, T, x.shape[-1], device=x.device, dtype=x.dtype)
        kwargs = {self.entry: placeholder, "output_attentions": self.output_attentions}
        if self.pads:
            kwargs["attention_mask"] = None if attention_mask is None else attention_mask.to(torch.long)
        if self.cache_name is not None:
            kwargs[self.cache_name] = cache
            kwargs["use_cache"] = use_cache
        if self.memory is not None:
            kwargs["encoder_hidden_states"] = self.memory.to(device=x.device, dtype=x.dtype).expand(B, -1, -1)
        call = lambda: self._stack(**accepted(self._stack.forward, kwargs))  # noqa: E731
        out = drive(call, self._all[self.span[0]], self._all[self.span[1]], x, entered, self._all[0], self._stack)
        return out, seen.get("cache")

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(x, attention_mask)[0]

    def single_layers(self) -> list["HFLayers"]:
        """One wrapper per layer, each driven by the same model forward (for depth's per-layer view)."""
        out = []
        for i in range(self.span[0], self.span[1] + 1):
            one = HFLayers(self.model_type, self.config, self._stack, self._all, (i, i), self.memory)
            for name in ("causal", "positional", "by_design", "pads"):
                setattr(one, name, getattr(self, name))
            out.append(one)
        return out

    @property
    def decodes(self) -> bool:
        """Whether the model's forward takes a cache and hands its layers one (kvcache.has_decode reads it): one that
        takes none (decision_transformer's) leaves nothing to compare, and transformers 4.x's gpt2 hands its layers
        tuples of its own past (no cache object tblock follows). The second is found by one one-token forward, once."""
        if self.cache_name is None or not self.causal:
            return self.cache_name is not None
        if "_hands_cache" not in self.__dict__:
            p = next(self.layers.parameters())
            width = getattr(self.config, "hidden_size", None) or getattr(self.config, "d_model", None)
            try:
                with torch.no_grad():
                    x = torch.zeros(1, 1, width, device=p.device, dtype=p.dtype)
                    self.__dict__["_hands_cache"] = self.run(x, None, None, use_cache=True)[1] is not None
            except Exception:  # noqa: BLE001 - no width to probe with, or a refusal: the decode itself will say why
                self.__dict__["_hands_cache"] = True
        return self.__dict__["_hands_cache"]

    def decode(self, x: torch.Tensor, cache=None):
        """tblock's decode protocol through the cache the model itself makes (hybrid models make a hybrid one)."""
        if not self.causal:
            raise ValueError(f"{self.model_type} is bidirectional: its outputs change as tokens arrive, no cached decoding")
        if self.cache_name is None:
            raise ValueError(f"{type(self._stack).__name__}.forward takes no cache")
        y, cache = self.run(x, None, cache, use_cache=True)
        if cache is None:
            raise ValueError(f"{self.model_type}'s forward passed no cache to its layers")
        return y, cache


def _is_cache(v) -> bool:
    from transformers.cache_utils import Cache

    return isinstance(v, Cache)
