"""The spec card: what a block computes, one entry per defining number, each with how it was read; and the judge
that holds a card against what the block claims to be (--expect KEY=VALUE, or the card of a --like reference)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from tblock_cli.errors import ConfigError

# The vocabulary of the card: key -> what it is. `spec` prints these keys and `--expect` takes them; docs/spec.md
# says how each is read and its tolerance. A value is a number, a bool, a word ("none" for an absent feature) or a
# tuple of numbers.
KEYS: dict[str, str] = {
    # attention
    "attn.heads": "query heads",
    "attn.kv_heads": "key/value heads (fewer than attn.heads: grouped-query)",
    "attn.group": "query heads per key/value head (attn.heads / attn.kv_heads; 1 for multi-head attention)",
    "attn.kv_grouping": "which query heads share a key/value head: contiguous (h reads h // group) or strided (h reads h mod kv_heads)",
    "attn.head_dim": "channels per head in the q.k product",
    "attn.scale": "X in the score scale 1/sqrt(X) (the head dim for the usual scaling)",
    "attn.softcap": "the logit soft-cap c of c*tanh(s/c), or none",
    "attn.window": "sliding-window size in tokens (a query sees this many keys, itself included), or none",
    "attn.causal": "queries ignore later keys",
    "attn.clip": "the clamp c on the q (and k, v) projections' outputs, clip_qkv's [-c, c], or none",
    "attn.qk_norm": "a norm on queries and keys: none, head (per head) or width (over the whole projection); any (claimed: either)",
    # positions
    "pos.kind": "how positions enter: none, absolute, rotary, alibi, relative_bias, bias or other",
    "rope.theta": "the rotary base theta (frequencies theta^(-2i/dims))",
    "rope.dims": "channels per head that rotate",
    "rope.place": "where a partial rotation's channels sit in the head at the q.k product: first (q[..., :dims], every partial rotary of transformers'), last (multi-head latent attention's rope part) or other",
    "rope.pairing": "which channels rotate together: half (i, i + dims/2) or interleaved (2i, 2i + 1)",
    "rope.direction": "which way each pair turns as the position grows: forward (x0 cos - x1 sin, x1 cos + x0 sin: Llama's and nearly every family's checkpoints) or backward (nanochat's)",
    "rope.scaling": "the frequency scaling: none, linear, ntk, llama3, yarn or other",
    "rope.factor": "the scaling's factor (1 for none)",
    "rope.freqs": "radians per position of each rotating pair, slowest last",
    "rope.low_freq_wavelen": "llama-3 scaling: the wavelength from which pairs are divided by the whole factor (original max position / low_freq_factor)",
    "rope.high_freq_wavelen": "llama-3 scaling: the wavelength below which pairs are kept (original max position / high_freq_factor)",
    "alibi.slopes": "ALiBi slope per head",
    "relbias.bidirectional": "a relative bias that changes with distance among the keys after the query too (T5's bidirectional buckets)",
    "relbias.curve": "the relative bias against distance (head 0), from -16 to +16",
    "relbias.steps": "the distances j - i at which the relative bias changes value (its bucket boundaries)",
    # FFN
    "ffn.gated": "a gated FFN (act(gate) * up)",
    "ffn.act": "the FFN activation: relu, relu2, gelu, gelu_tanh, silu, quick_gelu, ... (silu(gate*up): act of the product; silu(gate)*silu(up): act on both halves)",
    "ffn.hidden": "the FFN's hidden width",
    # norms
    "norm.kind": "layernorm or rmsnorm",
    "norm.eps": "the norms' variance floor eps",
    "norm.eps_form": "where eps enters: sqrt (x / sqrt(var + eps)) or std (x / (std + eps))",
    "norm.offset": "a (1 + w) weight: the norm scales by 1 where its weight is 0",
    "norm.placement": "pre, post, sandwich or olmo2 (each sublayer's output normalised before the add)",
    # residual
    "residual.form": "sequential (FFN reads attention's output) or parallel",
    "residual.stream_gain": "the factor on the residual stream at each add (DeepNorm's alpha; 1 usually)",
    "residual.attn_gain": "the factor on attention's output at its add (LayerScale, a branch gain; 1 usually)",
    "residual.ffn_gain": "the factor on the FFN's output at its add",
    # mixture of experts
    "moe.experts": "routed experts",
    "moe.top_k": "experts per token",
    "moe.router": "the router's scores: softmax or sigmoid",
    "moe.renorm": "the chosen experts' weights renormalised to sum to 1",
    "moe.weight_sum": "the sum of one token's routing weights with every expert made identical",
    "moe.shared": "a shared expert every token goes through",
    "moe.shared_gate": "the shared expert's per-token gate: sigmoid, none or other",
    "moe.scale": "a constant factor on the routing weights (DeepSeek-V3's routed_scaling_factor; 1 usually)",
    "moe.select": "which experts are chosen: top (the largest router outputs) or other (a selection bias, groups)",
    "moe.groups": "group-limited routing: n_group/topk_group (\"8/4\": the experts in 8 contiguous groups, each token's "
                  "top-k among its 4 best groups; \"strided\": expert e in group e % n_group), none for the plain top-k; "
                  "the limits the probe cannot tell apart are all listed",
    # biases
    "bias.qkv": "some query, key or value projection adds a bias",
    "bias.attn": "some attention projection (query, key, value or output) adds a bias",
    "bias.ffn": "some FFN projection adds a bias",
    "bias.any": "some attention or FFN projection adds a bias",
}

# Keys whose value is a number (or numbers): a word for one of them is refused (exit 2), not judged as a mismatch.
# The words such a key may still take are those the card writes for it (WORDS).
NUMERIC = ("attn.heads", "attn.kv_heads", "attn.group", "attn.head_dim", "attn.scale", "attn.softcap", "attn.window", "attn.clip",
           "rope.theta", "rope.dims", "rope.factor", "rope.freqs", "rope.low_freq_wavelen", "rope.high_freq_wavelen",
           "alibi.slopes", "relbias.curve", "relbias.steps", "ffn.hidden", "norm.eps", "residual.stream_gain",
           "residual.attn_gain", "residual.ffn_gain", "moe.experts", "moe.top_k", "moe.weight_sum", "moe.scale")
WORDS = {"attn.softcap": ("none",), "attn.window": ("none",), "attn.clip": ("none",), "moe.weight_sum": ("varies",)}
# Keys whose value is a tuple of readings the card's probe could not tell apart: a claim holds where it is one of them
ALTERNATIVES = ("moe.groups",)
# Keys whose value is true or false: anything else for one of them is refused (exit 2) as well.
BOOLEAN = ("attn.causal", "relbias.bidirectional", "ffn.gated", "norm.offset", "moe.renorm", "moe.shared", "bias.qkv",
           "bias.attn", "bias.ffn", "bias.any")


@dataclass(frozen=True)
class Entry:
    """One measured number of the card: its value, how it was read, and how closely a declaration must match it."""

    key: str
    value: object = None  # None where it could not be read (then `skip` says why)
    how: str = ""  # one line: what was measured
    tol: float = 0.0  # relative tolerance for numbers (and each number of a tuple); 0: exact
    skip: str | None = None  # why it could not be read
    judged: bool = True  # held against a --like reference's card (False: shown, compared only when --expect names it)

    @property
    def read(self) -> bool:
        return self.skip is None and self.value is not None

    def to_dict(self) -> dict:
        d = {"key": self.key, "value": list(self.value) if isinstance(self.value, tuple) else self.value, "how": self.how}
        if self.tol:
            d["tol"] = self.tol
        if self.skip is not None:
            d["skip"] = self.skip
        return d


def skipped(key: str, why: str) -> Entry:
    return Entry(key, None, skip=why)


@dataclass(frozen=True)
class Card:
    """Every entry read off one block, in the order of KEYS."""

    subject: str
    entries: tuple[Entry, ...] = ()
    slips: tuple[str, ...] = field(default=())  # readers that raised: 'reader: error' (a slip is a fact, not a pass)

    def get(self, key: str) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def value(self, key: str):
        e = self.get(key)
        return e.value if e is not None and e.read else None

    def to_dict(self) -> dict:
        return {"subject": self.subject, "entries": [e.to_dict() for e in self.entries], "slips": list(self.slips)}


@dataclass(frozen=True)
class Claim:
    """What the block is declared to be for one key: the value and where the declaration came from."""

    key: str
    value: object
    source: str  # "--expect" or "--like hf:TYPE"
    tol: float = 0.0  # the reference entry's own tolerance (a --like card); --expect takes the measured entry's
    tier: str = ""  # what the block says of itself: asked (arguments, configs), kept (attributes) or named (classes);
    # convention: a --like family's way of doing something the block may not do at all (unread: no verdict)
    multiple: bool = False  # a whole multiple of the value matches too (a block's head count: differential heads)


@dataclass(frozen=True)
class Verdict:
    """One claim held against the card: match, differs, or unread (the block's entry could not be read)."""

    key: str
    status: str  # match | differs | unread
    claimed: object
    measured: object
    source: str
    why: str | None = None  # for unread: the card's skip reason

    def to_dict(self) -> dict:
        plain = lambda v: list(v) if isinstance(v, tuple) else v
        d = {"key": self.key, "status": self.status, "claimed": plain(self.claimed), "measured": plain(self.measured),
             "source": self.source}
        if self.why:
            d["why"] = self.why
        return d


def parse_value(text: str):
    """A --expect value: true/false, none, a number, numbers separated by commas, else the word itself."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", ""):
        return "none"
    parts = [p.strip() for p in t.split(",")]
    try:
        nums = tuple(float(p) for p in parts)
    except ValueError:
        return low
    if not all(math.isfinite(n) for n in nums):
        raise ConfigError(f"--expect: {text!r} is not a finite number")
    return nums[0] if len(nums) == 1 else nums


def parse_expect(items) -> tuple[Claim, ...]:
    """--expect KEY=VALUE items (a list, or one comma-free string per item) as claims; unknown keys refused."""
    if items is None:
        return ()
    if isinstance(items, str):
        items = [items]
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    claims = []
    for item in items:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"--expect takes KEY=VALUE (e.g. rope.theta=500000), got {item!r}")
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in KEYS:
            close = difflib.get_close_matches(key, list(KEYS), n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"--expect: no card entry {key!r}; {hint}see `tblock spec --help` or docs/spec.md")
        parsed = parse_value(value)
        if key in NUMERIC and (isinstance(parsed, bool) or isinstance(parsed, str)) and parsed not in WORDS.get(key, ()):
            allowed = "".join(f" or {w}" for w in WORDS.get(key, ()))
            raise ConfigError(f"--expect {key} takes a number{allowed}, got {value.strip()!r}")
        if key in BOOLEAN and not isinstance(parsed, bool):
            raise ConfigError(f"--expect {key} takes true or false, got {value.strip()!r}")
        claims.append(Claim(key, parsed, "--expect"))
    return tuple(claims)


def claims_from_card(card: Card, source: str) -> tuple[Claim, ...]:
    """A reference card's judged, read entries as claims about the block under test."""
    return tuple(Claim(e.key, e.value, source, e.tol) for e in card.entries if e.read and e.judged)


def same(claimed, measured, tol: float) -> bool:
    """Equal within a relative tolerance (numbers, and tuples of numbers elementwise); words and bools exactly."""
    if claimed == "any" and isinstance(measured, str):  # a switch that claims the trait in whichever form
        return measured.lower() != "none"
    if isinstance(claimed, bool) or isinstance(measured, bool):
        return isinstance(claimed, bool) and isinstance(measured, bool) and claimed == measured
    if isinstance(claimed, (int, float)) and isinstance(measured, (int, float)):
        return abs(claimed - measured) <= tol * max(abs(claimed), abs(measured)) + (0 if tol else 1e-12)
    if isinstance(claimed, tuple) and isinstance(measured, tuple):
        return len(claimed) == len(measured) and all(same(a, b, tol) for a, b in zip(claimed, measured))
    if isinstance(claimed, (int, float)) and isinstance(measured, tuple) and len(measured) == 1:
        return same(claimed, measured[0], tol)
    return str(claimed).lower() == str(measured).lower()


def judge(card: Card, claims: tuple[Claim, ...]) -> tuple[Verdict, ...]:
    """Each claim against the card; a later claim for a key (--expect after --like) replaces an earlier one."""
    last: dict[str, Claim] = {}
    for c in claims:
        last[c.key] = c
    out = []
    for key in KEYS:
        c = last.get(key)
        if c is None:
            continue
        e = card.get(key)
        if e is None or not e.read:
            if c.tier == "convention":  # a family's convention says nothing of a block that does not have the trait
                continue
            out.append(Verdict(key, "unread", c.value, None, c.source, e.skip if e is not None else "not measured"))
            continue
        tol = max(e.tol, c.tol)
        if key in ALTERNATIVES and isinstance(e.value, tuple):  # any of the readings the probe could not tell apart
            ok = any(same(v, m, tol) for v in (c.value if isinstance(c.value, tuple) else (c.value,)) for m in e.value)
        elif isinstance(c.value, tuple) and key not in NUMERIC:  # a claim of any of some words (GeGLU: either gelu)
            ok = any(same(v, e.value, tol) for v in c.value)
        else:
            ok = same(c.value, e.value, tol) or (c.multiple and _multiple_of(e.value, c.value))
        out.append(Verdict(key, "match" if ok else "differs", c.value, e.value, c.source))
    return tuple(out)


def _multiple_of(measured, claimed) -> bool:
    return isinstance(measured, (int, float)) and isinstance(claimed, (int, float)) and claimed > 0 \
        and measured >= claimed and measured % claimed == 0
