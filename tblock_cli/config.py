"""The block's configuration: every shared flag, its default, its validation, and the presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from tblock_cli.errors import ConfigError

NORMS = ("pre", "post", "mixed")
PAD_MEANS = ("pad", "keep")
# Upper bounds that keep every size product inside int64 and every seed inside torch's range; the
# free-memory gate refuses anything that would not fit long before these.
MAX_WIDTH = 2**20  # d_model and d_ff
MAX_COUNT = {"layers": 4096, "batch": 2**20, "seq": 2**22, "n_heads": 2**16}
MAX_SEED = 2**63 - 1
ACTIVATIONS = ("gelu", "relu")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class BlockConfig:
    d_model: int = 512  # width of the residual stream
    n_heads: int = 8  # must divide d_model: each head gets d_model / n_heads channels
    d_ff: int | None = None  # FFN hidden width; None means 4 * d_model, the seed's rule
    dropout: float = 0.1  # attention-weight and FFN dropout; only active in train mode
    norm: str = "pre"  # pre: x + f(LN(x)); post: LN(x + f(x)); mixed alternates (depth only)
    activation: str = "gelu"  # the FFN's non-linearity; relu where gelu was meant is a classic slip
    eps: float = 1e-5  # LayerNorm's variance floor; 0 gives NaN on a constant token
    bias: bool = True  # biases in every Linear and LayerNorm
    causal: bool = False  # mask attention to future positions
    layers: int = 1  # blocks in the stack; a Pre-LN stack of several ends with a LayerNorm
    final_norm: bool = True  # the final LayerNorm of a Pre-LN stack (depth can switch it off)
    batch: int = 2  # samples per input; kept different from seq so axis mix-ups show
    seq: int = 10  # tokens per sample
    dtype: str = "float32"  # parameter and activation dtype
    device: str = "auto"  # auto = cuda when present, else cpu
    seed: int = 0  # seeds the weights and the random inputs, so runs repeat
    threads: int | None = None  # torch intra-op threads; None keeps torch's default (contention shows in bench)
    positional: bool = False  # the block has positions inside (RoPE, ALiBi, relative bias): token order matters
    pad_keyword: str | None = None  # forward keyword that takes the padding mask; None = detect a known name
    pad_means: str = "pad"  # what True means in the block's mask: pad (PyTorch's key_padding_mask) or keep (HF's)
    warnings: tuple[str, ...] = field(default=(), compare=False)  # filled by validate()

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["d_ff"] = self.ffn_dim
        d.pop("warnings")
        return d


# Published shapes of well-known blocks. Sources: GPT-2, Radford et al. 2019, "Language Models are
# Unsupervised Multitask Learners", table 2, with Hugging Face's GPT2Config (n_inner = 4 * n_embd,
# layer_norm_epsilon = 1e-5, activation gelu_new, Pre-LN with a final ln_f, causal); BERT, Devlin et
# al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers", section 3 (BASE: L=12, H=768,
# A=12; LARGE: L=24, H=1024, A=16; d_ff = 4H), with Hugging Face's BertConfig (hidden_act gelu,
# layer_norm_eps = 1e-12, Post-LN, hidden_dropout_prob 0.1). GPT-2's gelu_new is the tanh
# approximation of GELU; tblock's gelu is the exact one, which changes no count.
PRESETS: dict[str, dict] = {
    "gpt2-small": dict(d_model=768, n_heads=12, d_ff=3072, layers=12, norm="pre", activation="gelu", eps=1e-5, causal=True),
    "gpt2-medium": dict(d_model=1024, n_heads=16, d_ff=4096, layers=24, norm="pre", activation="gelu", eps=1e-5, causal=True),
    "gpt2-large": dict(d_model=1280, n_heads=20, d_ff=5120, layers=36, norm="pre", activation="gelu", eps=1e-5, causal=True),
    "gpt2-xl": dict(d_model=1600, n_heads=25, d_ff=6400, layers=48, norm="pre", activation="gelu", eps=1e-5, causal=True),
    "bert-base": dict(d_model=768, n_heads=12, d_ff=3072, layers=12, norm="post", activation="gelu", eps=1e-12),
    "bert-large": dict(d_model=1024, n_heads=16, d_ff=4096, layers=24, norm="post", activation="gelu", eps=1e-12),
}


def build_config(preset: str | None = None, *, allow_mixed: bool = False, builtin: bool = True, **flags) -> BlockConfig:
    """Defaults, then the preset, then the flags the user gave (None = not given); validated."""
    values: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        values.update(PRESETS[preset])
    values.update({k: v for k, v in flags.items() if v is not None})
    unknown = set(values) - {f.name for f in dataclasses.fields(BlockConfig)}
    if unknown:  # an internal slip, not a user's
        raise TypeError(f"unknown config fields: {sorted(unknown)}")
    cfg = BlockConfig(**values)
    return validate(cfg, allow_mixed=allow_mixed, builtin=builtin)


def validate(cfg: BlockConfig, *, allow_mixed: bool = False, builtin: bool = True) -> BlockConfig:
    """Raise ConfigError naming the flag to change; return cfg with its warnings filled in."""
    limits = {"d_model": MAX_WIDTH, "d_ff": MAX_WIDTH, **MAX_COUNT}
    for name, top in limits.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        if value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if value > top:
            raise ConfigError(f"--{name.replace('_', '-')} must be at most {top:,}, got {value:,}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2**63 - 1], got {cfg.seed}")
    if cfg.threads is not None and not 1 <= cfg.threads <= 1024:
        raise ConfigError(f"--threads must be in [1, 1024], got {cfg.threads}")
    for name in ("dropout", "eps"):
        if not math.isfinite(getattr(cfg, name)):
            raise ConfigError(f"--{name} must be a finite number, got {getattr(cfg, name)}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}; "
            f"each head needs d_model / n_heads channels"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not 0 <= cfg.eps < 1:
        raise ConfigError(f"--eps must be in [0, 1), got {cfg.eps}")
    if cfg.pad_means not in PAD_MEANS:
        raise ConfigError(f"--pad-means must be pad or keep, got {cfg.pad_means!r}")
    if cfg.pad_keyword is not None and not cfg.pad_keyword.isidentifier():
        raise ConfigError(f"--pad-keyword must be a Python keyword name, got {cfg.pad_keyword!r}")
    norms = NORMS if allow_mixed else NORMS[:2]
    if cfg.norm not in norms:
        raise ConfigError(f"--norm must be one of {', '.join(norms)}, got {cfg.norm!r}")
    if cfg.activation not in ACTIVATIONS:
        raise ConfigError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {cfg.activation!r}")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    warnings = []
    if cfg.eps == 0 and builtin:  # a user block builds its own norms; --eps does not reach them
        warnings.append("--eps 0: LayerNorm divides by the raw standard deviation; a constant token gives NaN")
    return dataclasses.replace(cfg, warnings=tuple(warnings))
