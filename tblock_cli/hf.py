"""Hugging Face layers driven as their model drives them: `--block hf:TYPE` with no adapter code.

The config comes from `AutoConfig.for_model(TYPE, ...)` with tblock's sizes and random weights (no hub,
no download). The base model is built with `AutoModel.from_config` only to take its layers and its
rotary module; the wrapper then calls the layers with the model's own mask construction
(`transformers.masking_utils`), rotary embeddings and position ids, and its own cache classes for
`decode`. transformers is imported here only, when an `hf:` block is asked for.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.config import BlockConfig
from tblock_cli.errors import LoadError, one_line

# The embeddings are never used (tblock feeds hidden states): a small vocabulary keeps them cheap.
VOCAB = 256


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise LoadError("--block hf:TYPE needs transformers: pip install 'tblock[hf]'") from None
    transformers.logging.set_verbosity_error()  # config notes about token ids of a vocabulary tblock never uses
    return transformers


def build_config(model_type: str, cfg: BlockConfig, extra: dict):
    """AutoConfig.for_model with tblock's sizes; --kwargs override any of them (e.g. num_key_value_heads)."""
    transformers = import_transformers()
    from transformers import AutoConfig

    if not model_type:
        raise LoadError("--block hf:TYPE needs a transformers model type, e.g. hf:gpt2, hf:bert, hf:llama")
    extra = dict(extra)
    attn = extra.pop("attn_implementation", None)
    sizes = {
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.layers, "vocab_size": VOCAB, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    try:
        config = AutoConfig.for_model(model_type, **sizes)
    except (ValueError, KeyError) as e:
        known = sorted(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
        close = [k for k in known if model_type.lower().replace("-", "_") in k][:8]
        raise LoadError(f"--block hf:{model_type}: not a transformers model type ({type(e).__name__}); "
                        f"{'did you mean ' + ', '.join(close) if close else 'e.g. gpt2, bert, llama, qwen2, mistral'}") from None
    # Names some configs use for the same sizes, set only where the config has them.
    for name, value in (("n_inner", cfg.ffn_dim), ("head_dim", cfg.d_model // cfg.n_heads), ("num_key_value_heads", cfg.n_heads)):
        if hasattr(config, name) and name not in extra:
            setattr(config, name, value)
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "attn_pdrop", "embd_pdrop",
                 "attention_dropout", "hidden_dropout", "resid_dropout", "embd_dropout", "dropout"):
        if isinstance(getattr(config, name, None), float) and name not in extra:
            setattr(config, name, cfg.dropout)
    for k, v in extra.items():
        setattr(config, k, v)
    if attn is not None:
        config._attn_implementation = attn
    return config


def is_encoder(model_type: str, config) -> bool:
    """Bidirectional (BERT, RoBERTa, ...): a masked-LM family whose config is not set as a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)


class HFLayers(nn.Module):
    """The model's layers, called as its forward calls them; (B, T, d) in and out.

    attention_mask: (B, T), 1 = keep (HF's convention), turned into the model's own 4-D mask.
    """

    def __init__(self, model_type: str, config, layers: nn.ModuleList, rotary: nn.Module | None):
        super().__init__()
        self.model_type, self.config = model_type, config
        self.causal = not is_encoder(model_type, config)
        self.layers, self.rotary = layers, rotary
        self.output_attentions = False  # HF's need_weights; bench --need-weights forces it
        params = inspect.signature(self.layers[0].forward).parameters
        self.cache_name = next((n for n in ("cache", "past_key_values", "past_key_value", "layer_past") if n in params), None)

    @classmethod
    def of_model(cls, model_type: str, config, base: nn.Module) -> "HFLayers":
        """The layer list and rotary module of a base model built from config."""
        lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == config.num_hidden_layers]
        if not lists:
            raise LoadError(f"--block hf:{model_type}: found no list of {config.num_hidden_layers} layers in {type(base).__name__}")
        rotary = next((m for m in base.modules() if "rotary" in type(m).__name__.lower()), None)
        return cls(model_type, config, lists[0], rotary)

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

    @property
    def positional(self) -> bool:
        """Positions live inside the layers (rotary), not only in the embeddings tblock leaves out."""
        return self.rotary is not None

    def masks(self, x: torch.Tensor, attention_mask: torch.Tensor | None, cache, position_ids):
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.long)
        if self.causal:
            return create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                      position_ids=position_ids)
        return create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask)

    def run(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(x.shape[1], device=x.device) + past).unsqueeze(0)
        mask = self.masks(x, attention_mask, cache, position_ids)
        kwargs = {"attention_mask": mask, "position_ids": position_ids, "use_cache": cache is not None,
                  "output_attentions": self.output_attentions}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(x, position_ids=position_ids)
        if self.cache_name is not None:
            kwargs[self.cache_name] = cache
        h = x
        for layer in self.layers:
            out = layer(h, **accepted(layer.forward, kwargs))
            h = out[0] if isinstance(out, (tuple, list)) else out
        return h

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(x, attention_mask)

    def single_layers(self) -> list["HFLayers"]:
        """One wrapper per layer, sharing the config and rotary module (for depth's per-layer view)."""
        return [HFLayers(self.model_type, self.config, nn.ModuleList([layer]), self.rotary) for layer in self.layers]

    def decode(self, x: torch.Tensor, cache=None):
        """tblock's decode protocol through the model's own DynamicCache."""
        if not self.causal:
            raise ValueError(f"{self.model_type} is bidirectional: its outputs change as tokens arrive, no cached decoding")
        from transformers import DynamicCache

        cache = cache if cache is not None else DynamicCache(config=self.config)
        return self.run(x, None, cache), cache


def accepted(fn, kwargs: dict) -> dict:
    """The keywords fn takes (all of them when it takes **kwargs), None values dropped."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in kwargs.items() if v is not None}
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def build(model_type: str, cfg: BlockConfig, extra: dict) -> HFLayers:
    """The wrapped layers of a randomly initialised TYPE model of tblock's sizes (seeded by --seed)."""
    import_transformers()
    from transformers import AutoModel

    from tblock_cli.hfinit import from_config_once

    config = build_config(model_type, cfg, extra)
    torch.manual_seed(cfg.seed)
    try:
        base = from_config_once(AutoModel, config)
    except Exception as e:  # noqa: BLE001 - a size the model rejects: say which
        raise LoadError(f"--block hf:{model_type}: building the model failed: {one_line(e)}") from None
    return HFLayers.of_model(model_type, config, base)
