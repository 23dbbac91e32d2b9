"""The block's configuration: every shared flag declared once (value, default, help, validation), and the presets."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from tblock_cli.errors import ConfigError

NORMS = ("pre", "post", "mixed")
PAD_MEANS = ("pad", "keep")
# Upper bounds that keep every size product inside int64 and every seed inside torch's range; the
# free-memory gate refuses anything that would not fit long before these.
MAX_WIDTH = 2**20  # d_model and d_ff
MAX_COUNT = {"layers": 4096, "batch": 2**20, "seq": 2**22, "n_heads": 2**16}
MAX_SEED = 2**63 - 1
MAX_THREADS = 1024
ACTIVATIONS = ("gelu", "relu")
DTYPES = ("float32", "float16", "bfloat16")
DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")

# The help panels the shared flags are listed under.
BLOCK = "Block (shared by every command)"
RUN = "Input and device"
COMMANDS = ("check", "spec", "params", "bench", "depth", "compare")
LOADS = ("check", "spec", "params", "bench", "depth")  # the commands with one --block (compare takes two SPECs)


@dataclass(frozen=True)
class Flag:
    """What the command line, the API and bench --compare know about one shared option."""

    help: str
    type: type = int  # what the value must be (a bool is no int here; an int is a fine float)
    default_text: str | None = None  # the default as --help shows it; None: the field's default
    panel: str = BLOCK
    builtin_only: bool = False  # shapes only the built-in block: warned when given with a user block
    compared: bool = True  # must match for bench --compare to compare two runs
    constructor: bool = False  # offered to a user block's constructor, under the names it uses (loading.ALIASES)
    commands: tuple[str, ...] = COMMANDS  # the commands that take it
    switch: bool = False  # a --name/--no-name switch

    @staticmethod
    def option(name: str) -> str:
        return "--" + name.replace("_", "-")


def flag(default, help: str, **meta):
    return field(default=default, metadata={"flag": Flag(help, **meta)})


PADDING = ("check", "params", "bench", "compare")  # depth builds its own stacks: no padding to describe


@dataclass(frozen=True)
class BlockConfig:
    d_model: int = flag(512, "Width of the residual stream.", constructor=True)
    # must divide d_model: each head gets d_model / n_heads channels
    n_heads: int = flag(8, "Attention heads; must divide --d-model.", constructor=True)
    # None means 4 * d_model, the seed's rule
    d_ff: int | None = flag(None, "FFN hidden width.", default_text="4 x d_model", constructor=True)
    # attention-weight and FFN dropout; only active in train mode
    dropout: float = flag(0.1, "Dropout probability, in [0, 1).", type=float, constructor=True)
    # pre: x + f(LN(x)); post: LN(x + f(x)); mixed alternates (depth only)
    norm: str = flag("pre", "LayerNorm placement: pre (x + f(LN(x))) or post (LN(x + f(x))); depth also takes mixed "
                     "(alternating, starting with pre).", type=str, builtin_only=True)
    # relu where gelu was meant is a classic slip
    activation: str = flag("gelu", "FFN activation: gelu or relu.", type=str, builtin_only=True)
    # LayerNorm's variance floor; 0 gives NaN on a constant token
    eps: float = flag(1e-5, "LayerNorm eps, in [0, 1); 0 is allowed but warned (NaN on a constant token).", type=float,
                      builtin_only=True)
    bias: bool = flag(True, "Biases in Linear and LayerNorm layers.", type=bool, switch=True, builtin_only=True,
                      default_text="--bias")
    causal: bool = flag(False, "Causal attention mask (and the causal checks).", type=bool, switch=True,
                        default_text="--no-causal", constructor=True)
    # a Pre-LN stack of several ends with a LayerNorm
    layers: int = flag(1, "Blocks in the stack; a Pre-LN stack gets a final LayerNorm.", default_text="the preset's, else 1",
                       builtin_only=True)
    # the final LayerNorm of a Pre-LN stack (depth can switch it off)
    final_norm: bool = flag(True, "A final LayerNorm after a Pre-LN last layer.", type=bool, switch=True, compared=False,
                            builtin_only=True, commands=("depth",), default_text="--final-norm")
    # samples per input; kept different from seq so axis mix-ups show
    batch: int = flag(2, "Samples per input.", panel=RUN)
    seq: int = flag(10, "Tokens per sample.", panel=RUN)
    dtype: str = flag("float32", "float32, float16 or bfloat16.", type=str, panel=RUN)
    device: str = flag("auto", "auto, cpu, cuda, cuda:N or mps; auto = cuda when present.", type=str, panel=RUN,
                       compared=False)  # compared through the environment's resolved device
    # seeds the weights and the random inputs, so runs repeat
    seed: int = flag(0, "Seeds weights and inputs.", panel=RUN, compared=False)
    # None keeps torch's default (contention shows in bench)
    threads: int | None = flag(None, "torch intra-op threads for the run.", panel=RUN, default_text="torch's",
                               compared=False)
    # RoPE, ALiBi, relative bias: token order matters
    positional: bool = flag(False, "The block has positions inside (RoPE, ALiBi, relative bias): token order matters, "
                            "the order check skips.", type=bool, switch=True, commands=PADDING, compared=False,
                            default_text="--no-positional")
    # None = detect a known name
    pad_keyword: str | None = flag(None, "Your forward's keyword for the padding mask, e.g. mask or attention_mask.",
                                   type=str, commands=PADDING, compared=False,
                                   default_text="detect pad_mask, key_padding_mask, ...")
    # pad (PyTorch's key_padding_mask) or keep (HF's)
    pad_means: str = flag("pad", "What True means in your block's mask: pad (PyTorch) or keep (HF, x-transformers).",
                          type=str, commands=PADDING, compared=False)
    # a model's layer, driven by the model's own forward: --block names the model (a class or builder over token ids)
    layer: int | None = flag(None, "Drive layer N of the model the SPEC builds (a class or builder over token ids) "
                             "through the model's own forward: its masks, positions and caches.", compared=False,
                             default_text="none: the SPEC builds one block")
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


# Shared options that are not config values: they say where the block comes from.
SOURCE_FLAGS: dict[str, Flag] = {
    "preset": Flag("A well-known shape (see `tblock params --list-presets`); explicit flags override it.", type=str,
                   default_text=""),
    "block": Flag("Your own block: package.module:NAME, path/to/file.py:NAME (a class or a factory), or hf:TYPE (a "
                  "Hugging Face layer, e.g. hf:llama).", type=str, default_text="", commands=LOADS),
    "kwargs": Flag("More constructor keywords for --block, as a JSON object.", type=str, default_text="", commands=LOADS),
}
# Every config field's flag, by name, in declaration order.
FLAGS: dict[str, Flag] = {f.name: f.metadata["flag"] for f in dataclasses.fields(BlockConfig) if "flag" in f.metadata}
DEFAULTS: dict[str, object] = {f.name: f.default for f in dataclasses.fields(BlockConfig) if "flag" in f.metadata}
BUILTIN_ONLY = tuple(k for k, f in FLAGS.items() if f.builtin_only)
COMPARED = tuple(k for k, f in FLAGS.items() if f.compared)
TO_CONSTRUCTOR = tuple(k for k, f in FLAGS.items() if f.constructor)


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
    values = preset_values(preset)
    given = {k: v for k, v in flags.items() if v is not None}
    unknown = set(given) - set(FLAGS)
    if unknown:  # an internal slip, not a user's
        raise TypeError(f"unknown config fields: {sorted(unknown)}")
    check_values(given, allow_mixed=allow_mixed)
    values.update(given)
    cfg = BlockConfig(**values)
    return validate(cfg, allow_mixed=allow_mixed, builtin=builtin)


def preset_values(preset: str | None) -> dict:
    """A --preset's shape (empty for none); an unknown name is refused with the known ones."""
    if preset is None:
        return {}
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return dict(PRESETS[preset])


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def check_type(name: str, value, kind: type) -> None:
    """Refuse a value of the wrong type (an API caller's "64" or True for an integer) naming the option."""
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{Flag.option(name)} must be {TYPE_NAMES[kind]}, got {value!r} ({type(value).__name__})")


def check_values(values: dict, *, allow_mixed: bool = True) -> None:
    """Each given value alone: its type, range or choices. Needs no torch, so the CLI refuses a bad flag at once."""
    for name, value in values.items():
        if value is None or name not in FLAGS:
            continue
        check_type(name, value, FLAGS[name].type)
        _check_one(name, value, allow_mixed)


def _check_one(name: str, value, allow_mixed: bool) -> None:
    flag_name = Flag.option(name)
    top = MAX_WIDTH if name in ("d_model", "d_ff") else MAX_COUNT.get(name)
    if top is not None:
        if value <= 0:
            raise ConfigError(f"{flag_name} must be > 0, got {value}")
        if value > top:
            raise ConfigError(f"{flag_name} must be at most {top:,}, got {value:,}")
    elif name == "seed" and not 0 <= value <= MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2**63 - 1], got {value}")
    elif name == "layer" and not 0 <= value < MAX_COUNT["layers"]:
        raise ConfigError(f"--layer must be in [0, {MAX_COUNT['layers'] - 1}], got {value}")
    elif name == "threads" and not 1 <= value <= MAX_THREADS:
        raise ConfigError(f"--threads must be in [1, {MAX_THREADS}], got {value}")
    elif name in ("dropout", "eps"):
        if not math.isfinite(value):
            raise ConfigError(f"{flag_name} must be a finite number, got {value}")
        if not 0 <= value < 1:
            raise ConfigError(f"{flag_name} must be in [0, 1), got {value}")
    elif name == "pad_means" and value not in PAD_MEANS:
        raise ConfigError(f"--pad-means must be pad or keep, got {value!r}")
    elif name == "pad_keyword" and not value.isidentifier():
        raise ConfigError(f"--pad-keyword must be a Python keyword name, got {value!r}")
    elif name == "norm":
        norms = NORMS if allow_mixed else NORMS[:2]
        if value not in norms:
            raise ConfigError(f"--norm must be one of {', '.join(norms)}, got {value!r}")
    elif name == "activation" and value not in ACTIVATIONS:
        raise ConfigError(f"--activation must be one of {', '.join(ACTIVATIONS)}, got {value!r}")
    elif name == "dtype" and value not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    elif name == "device" and not DEVICE.fullmatch(value):
        raise ConfigError(f"--device must be auto, cpu, cuda, cuda:N or mps, got {value!r}")


def validate(cfg: BlockConfig, *, allow_mixed: bool = False, builtin: bool = True) -> BlockConfig:
    """Raise ConfigError naming the flag to change; return cfg with its warnings filled in."""
    check_values({name: getattr(cfg, name) for name in FLAGS}, allow_mixed=allow_mixed)
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}; "
            f"each head needs d_model / n_heads channels"
        )
    warnings = []
    if cfg.eps == 0 and builtin:  # a user block builds its own norms; --eps does not reach them
        warnings.append("--eps 0: LayerNorm divides by the raw standard deviation; a constant token gives NaN")
    return dataclasses.replace(cfg, warnings=tuple(warnings))


def parse_kwargs(text: str | None, flag: str = "--kwargs") -> dict:
    """--kwargs (or another flag that takes keywords: --kwargs-a, --like-kwargs): a JSON object, refused under the
    flag's own name."""
    import json

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e.msg} (at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"norm_first\": true}}'")
    return value
