"""What a block is declared to be: --expect KEY=VALUE claims, and --like hf:TYPE, whose own layer is built at the
same sizes and read the same way (no table of config fields to keep in sync), and compared with weights carried."""

from __future__ import annotations

from dataclasses import dataclass

from tblock_cli.card.entries import Card, Claim, claims_from_card, parse_expect
from tblock_cli.config import parse_kwargs
from tblock_cli.errors import ConfigError, TBlockError, one_line

# Config fields that make a family's first layers dense (its MoE layers come later in the stack), and the values that
# make layer 0 an MoE layer: the --like reference's moe entries are read there, the rest on layer 0 as configured.
MOE_FIRST = {"first_k_dense_replace": 0, "moe_layer_start_index": 0, "mlp_only_layers": [], "decoder_sparse_step": 1,
             "encoder_sparse_step": 1}
# The size flags the --like reference is built at: the block under test's own, so only what the config says differs.
SIZES = ("d_model", "n_heads", "d_ff", "seq", "batch", "seed", "device", "threads")


@dataclass(frozen=True)
class Declaration:
    """Every claim about the block, the reference card they came from, and the reference comparison (check --like)."""

    claims: tuple[Claim, ...] = ()
    like: str | None = None
    reference: Card | None = None
    compared: object = None  # a comparing CompareReport of the block against the --like layer, weights carried
    compare_error: str | None = None  # why that comparison could not run


def validate(like, like_kwargs, expect) -> tuple[tuple[Claim, ...], dict | None]:
    """The declaration flags judged without torch: --like names an hf: layer, --like-kwargs is a JSON object,
    every --expect is KEY=VALUE with a known key."""
    if like is not None:
        if not isinstance(like, str) or not like.startswith("hf:") or len(like) <= 3:
            raise ConfigError(f"--like takes hf:TYPE (a Hugging Face layer, e.g. hf:llama), got {like!r}")
    kwargs = None
    if like_kwargs is not None:
        if like is None:
            raise ConfigError("--like-kwargs applies with --like hf:TYPE")
        if isinstance(like_kwargs, dict):
            kwargs = like_kwargs
        elif isinstance(like_kwargs, str):
            kwargs = parse_kwargs(like_kwargs, "--like-kwargs")
        else:
            raise ConfigError(f"--like-kwargs must be a JSON object string (or a dict), got {type(like_kwargs).__name__}")
    return parse_expect(expect), kwargs


def reference_options(cfg) -> dict:
    """The --like layer's size flags: the block under test's, as resolved (a width inferred from the block too)."""
    d = cfg.as_dict()
    return {k: d[k] for k in SIZES if d.get(k) is not None}


def declare(like, like_kwargs, expect, cfg, setup, *, compare_with=None, kwargs=None, progress=None) -> Declaration:
    """Claims from --expect and from the --like layer's card; with compare_with (the block under test as compare's
    side A takes it, and kwargs its --kwargs), also the comparison against that layer with the block's weights carried
    to it."""
    from tblock_cli.card.read import read_card

    claims, reference_kwargs = validate(like, like_kwargs, expect)
    if like is None:
        return Declaration(claims)
    options = reference_options(cfg)
    try:
        s = setup(like, {**options, **({"kwargs": reference_kwargs} if reference_kwargs else {})})
        layer = s.make()
    except TBlockError as e:  # the reference's own flags are --like and --like-kwargs: name them so
        raise type(e)(str(e).replace("--block ", "--like ", 1).replace("--kwargs:", "--like-kwargs:", 1)) from None
    reference = read_card(layer, s.cfg, s.device)
    if reference.value("moe.experts") == 0:  # a family whose first layers are dense: its moe entries from an MoE layer
        reference = moe_entries_of_a_moe_layer(reference, like, reference_kwargs, options,
                                               getattr(layer.module, "config", None), setup)
    source = f"--like {like}"
    compared = error = None
    if compare_with is not None:
        if progress is not None:
            progress("like: comparing with weights carried")
        from tblock_cli.comparing.run import run_compare

        try:
            compared = run_compare(compare_with, like, setup, options={k: v for k, v in options.items() if k != "threads"},
                                   kwargs_a=kwargs or None, kwargs_b=reference_kwargs)
        except TBlockError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - the block under test raised while compared: said in the check
            error = one_line(e)
    return Declaration(claims_from_card(reference, source) + grouping_convention(reference, source) + claims, like,
                       reference, compared, error)


def grouping_convention(reference: Card, source: str) -> tuple[Claim, ...]:
    """transformers groups query heads over key/value heads one way in every family (repeat_kv, sdpa's enable_gqa:
    query head h reads key head h // group): a --like layer built without grouping at these sizes still claims it, for
    a block under test that groups (judged only where the block's grouping is read)."""
    e = reference.get("attn.kv_grouping")
    if e is None or e.read:
        return ()
    return (Claim("attn.kv_grouping", "contiguous", f"{source} (transformers' repeat_kv)", tier="convention"),)


def moe_entries_of_a_moe_layer(reference: Card, like: str, kwargs, options: dict, config, setup) -> Card:
    """The reference card with its moe entries read on an MoE layer of the family, where its layer 0 is dense by
    config (DeepSeek-V3's first_k_dense_replace=3): a block that ports its MoE layer is held against those."""
    import dataclasses

    from tblock_cli.card import moe
    from tblock_cli.card.probe import float64_probe

    given = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    moved = {k: v for k, v in MOE_FIRST.items() if k in given and given[k] != v}
    if not moved:
        return reference
    try:
        s = setup(like, {**options, "kwargs": {**(kwargs or {}), **moved}})
        entries = moe.read(float64_probe(s.make(), s.cfg, s.device))
    except TBlockError:
        return reference
    if not entries or not entries[0].read or not entries[0].value:
        return reference
    said = ", ".join(f"{k}={v}" for k, v in moved.items())
    got = {e.key: dataclasses.replace(e, how=f"{e.how} (read on an MoE layer: {said})") if e.read else e for e in entries}
    return dataclasses.replace(reference, entries=tuple(got.get(e.key, e) for e in reference.entries))
