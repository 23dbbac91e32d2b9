"""Checks of what a block claims to be: its spec card against --expect / --like, and the --like layer itself with the
block's weights carried to it."""

from __future__ import annotations

import dataclasses
import math

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import module_copy


def check_spec(ctx: Context) -> Outcome:
    """Every declared card entry holds within its tolerance; an entry that cannot be read is said, never guessed.

    Catches: with `--like hf:TYPE` or `--expect KEY=VALUE`: a spec card entry (rotary base, dims and scaling, score
    scale, soft-cap, window, key/value head grouping, activation, eps, norm offset, q/k-norm axis, residual form and
    gains, MoE routing; [spec.md](spec.md)) that differs from the declaration, each named with both values; without a declaration, one
    that differs from what the block says of itself (a kept `rope_theta`, `softcap`, `rotary_dim`, an attention
    module's `scale`, a config's `hidden_act`, `num_experts_per_tok`, `head_dim`, `intermediate_size` or `num_key_value_heads` (and with it grouped-query attention's layout, query head h reading key head h // group), a head count the product does not split into, a LayerScale start (`layer_scale_init_value`), Granite's `residual_multiplier` and
    `attention_multiplier`, a `rope_scaling` (llama3's band ends too, on the whole table where no ramp shows them;
    YaRN's attention factor as the score scale), a LayerNorm class name with a bias, a kept
    `sliding_window` shorter than the probe (within one token), a rotary module that runs
    while no rotation reaches the scores, DeepSeek's `n_group`/`topk_group` (group-limited routing), T5's `d_kv`,
    Gemma's `use_bidirectional_attention`, OPT's `do_layer_norm_before`: [spec.md](spec.md)); skips when neither"""
    from tblock_cli.card.attention import COSINE, SCALE_SEQ
    from tblock_cli.card.entries import Claim, judge
    from tblock_cli.card.own_fit import fitted, needed
    from tblock_cli.card.read import read_card
    from tblock_cli.checks.training import block_claims, too_large

    decl = ctx.declaration
    claims = decl.claims if decl is not None else ()
    own = decl is None or (not decl.claims and decl.like is None)
    if own:
        claims = block_claims(ctx)  # only a block of the user's is held to what it says of itself
        if not claims:
            return skipped("spec.undeclared")
        if too_large(ctx) is not None:  # its float64 probe would copy the weights: only declared claims pay that
            return skipped("spec.own_claims_too_large", claims=[c.key for c in claims])
    elif not decl.claims:
        return skipped("spec.reference_unread", like=decl.like)
    keys = needed(claims)
    keys += ("attn.scale", "attn.head_dim") if any(c.key == "attn.softcap" for c in claims) else ()
    card = _half_table(read_card(ctx.subject, ctx.cfg, ctx.device, progress=ctx.step, keys=keys if own else None), ctx.dtype)
    if own:
        # a config's routing says nothing of a dense layer (DeepSeek's first), its FFN width nothing of an expert
        claims = fitted(claims, card, SCALE_SEQ, ctx.cfg.d_model)
        # a norm module's own eps or class name speaks for that module; the card reads the stream's norms, which may be
        # others (an F.layer_norm or nn.LayerNorm on the stream, RMSNorms on q and k): such a claim stands against the
        # card only where one of those modules itself does not do what it says
        claims = tuple(c for c in claims if c.key not in ("norm.eps", "norm.kind") or c.tier == "asked"
                       or judge(card, (c,))[0].status != "differs" or _norm_module_contradicts(ctx, c))
    scale = card.get("attn.scale")
    if own and scale is not None and COSINE in scale.how:  # a temperature scales cosine scores: a bare `scale` kept
        claims = tuple(c for c in claims if not (c.key == "attn.scale" and c.source.endswith(".scale")))
    if own and any(c.key.startswith("rope.") for c in claims) and card.value("pos.kind") in ("none", "other"):
        ran = _rotary_that_runs(ctx)
        if ran is not None:  # a rotary module that runs, and no rotation in the scores: it never reaches them
            claims += (Claim("pos.kind", "rotary", f"the block's own rotary module `{ran}` (it runs in the forward)"),)
    if not claims:
        return skipped("spec.undeclared")
    verdicts = judge(card, claims)
    if own or decl.claims:
        verdicts = _form_unfitted(_band_by_table(verdicts, card, claims, ctx.dtype), card)
    differs = [v.to_dict() for v in verdicts if v.status == "differs"]
    unread = [v.key for v in verdicts if v.status == "unread"]
    matched = sum(v.status == "match" for v in verdicts)
    facts = {"matched": matched, "unread": len(unread), "unread_keys": unread, "slips": list(card.slips),
             "own": own}
    if differs:
        return failed("spec.not_like", len(differs), differs=differs, **facts)
    if not matched:
        return skipped("spec.nothing_read", **facts)
    if (capped := _capped_scale(card, claims)) is not None:
        if abs(math.log(capped["ratio"] / capped["softcap"])) < math.log(CAP_SIGNATURE):
            # the slope is the cap's own multiple of 1/sqrt(head dim): cap * tanh(s), the division by the cap lost
            return failed("spec.cap_not_divided", round(capped["ratio"], 3), **capped, **facts)
        return warned("spec.capped_scale", round(capped["ratio"], 3), **capped, **facts)
    if card.value("moe.top_k") == 1 and card.value("moe.renorm") is True:
        # one expert per token, its weight renormalised over the chosen one: p / p = 1 whatever the router computes
        return warned("spec.constant_gate", 1, experts=card.value("moe.experts"), **facts)
    return passed("spec.matches", matched, **facts)


def _half_table(card, dtype):
    """In a float16 run, a rotary table whose slowest frequencies sit below float16's normal range (6.1e-5 radians per
    position: theta 5e5 at 64 dims, or a scaling's divided pairs) holds them rounded to its subnormal steps, so its
    scaling and band are not what the block computes by design: those entries unread (the precision and dtype checks
    judge the rounding)."""
    import torch

    from tblock_cli.card.entries import skipped

    freqs, tiny = card.value("rope.freqs"), torch.finfo(torch.float16).tiny
    if dtype != torch.float16 or not isinstance(freqs, tuple) or not freqs or min(freqs) >= tiny:
        return card
    why = f"float16 holds this table's slowest frequencies ({min(freqs):.1e} per position) below its normal range ({tiny:.1e})"
    rounded = ("rope.scaling", "rope.factor", "rope.low_freq_wavelen", "rope.high_freq_wavelen")
    return dataclasses.replace(card, entries=tuple(skipped(e.key, why) if e.key in rounded else e for e in card.entries))


# A capped slope within this factor of the cap itself (either way) is the cap multiplied in: cap * tanh(s) where
# cap * tanh(s / cap) was meant, at 1/sqrt(head dim) otherwise. A scale that far off by design would have to land on
# the cap's own value.
CAP_SIGNATURE = 1.25


def _capped_scale(card, claims) -> dict | None:
    """Under a soft-cap the attention check cannot read the score scale off the logits' spread (the tanh bends it);
    the card's slope at small logits can. Held to the same convention as there (1/sqrt(head dim), warned past
    attention's limits) where the block claims no scale of its own: cap * tanh(s) for cap * tanh(s / cap) multiplies
    the slope by the cap. None where nothing is capped, a scale is claimed, or the slope is within the limits."""
    from tblock_cli.checks.attention import OVERSCALED_RATIO, unscaled_limit

    X, E, cap = card.value("attn.scale"), card.value("attn.head_dim"), card.value("attn.softcap")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (X, E, cap))
    if not numbers or any(c.key == "attn.scale" for c in claims):
        return None
    ratio = (E / X) ** 0.5  # the slope against 1/sqrt(head dim)
    if OVERSCALED_RATIO < ratio < unscaled_limit(int(E)):
        return None
    return {"ratio": ratio, "scale": X, "head_dim": E, "softcap": cap, "limit": unscaled_limit(int(E)),
            "low": OVERSCALED_RATIO}


# the relative gap, per pair, between the table a llama-3 claim predicts and the one measured (the block's float32
# table against float64 arithmetic: 1e-7)
TABLE_TOL = 1e-3
BAND = ("rope.low_freq_wavelen", "rope.high_freq_wavelen")


def _band_by_table(verdicts, card, claims, dtype):
    """llama-3's band ends, where the card could not read them off a ramp (fewer than two pairs inside the band, as
    the block computes it), judged on the whole table instead: theta's plain table (the card's fitted theta, on the
    fast pairs llama-3 leaves alone) scaled as the claimed factor and band say, pair by pair, against the frequencies
    measured. A band the claim puts pairs in that the block scales all the way (its ends swapped, frequency taken for
    wavelength) differs; a table that is the claim's, its band holding no pair, matches. Not in half precision, whose
    table is rounded by design."""
    import torch

    said = {c.key: c.value for c in claims}
    unread = [v for v in verdicts if v.key in BAND and v.status == "unread"]
    scaled = all(v.status == "match" for v in verdicts if v.key in ("rope.scaling", "rope.factor"))
    if not unread or not scaled or said.get("rope.scaling") != "llama3" or dtype in (torch.float16, torch.bfloat16):
        return verdicts  # a table not scaled as claimed is said once, by its scaling or factor
    freqs, theta, dims = card.value("rope.freqs"), card.value("rope.theta"), card.value("rope.dims")
    factor, low_wl, high_wl = said.get("rope.factor"), said.get(BAND[0]), said.get(BAND[1])
    numbers = (theta, dims, factor, low_wl, high_wl)
    if not isinstance(freqs, tuple) or not freqs or not all(isinstance(v, (int, float)) and v > 0 for v in numbers) \
            or not low_wl > high_wl or len(freqs) != int(dims) // 2:
        return verdicts
    predicted = []
    for i in range(len(freqs)):
        f = theta ** (-2 * i / dims)
        wl = 2 * math.pi / f
        smooth = (1 / wl - 1 / low_wl) / (1 / high_wl - 1 / low_wl)
        predicted.append(f if wl < high_wl else f / factor if wl > low_wl else (1 - smooth) * f / factor + smooth * f)
    gaps = [abs(m - p) / p for m, p in zip(freqs, predicted)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    if gaps[worst] <= TABLE_TOL:  # the claim's table: the band's ends as said
        return _settled(verdicts, unread, "match")
    measured = (f"pair {worst} turns {freqs[worst]:.4g} rad per position, where this band gives {predicted[worst]:.4g} "
                f"({gaps[worst]:.0%} off)")
    return _settled(verdicts, unread, "differs", measured)


def _form_unfitted(verdicts, card):
    """A renormalisation or a routed scale is said of a softmax or sigmoid router (Mixtral's, Qwen-MoE's
    `norm_topk_prob`, DeepSeek's `routed_scaling_factor`): where the routing weights fit no softmax or sigmoid of the
    router's outputs, over the chosen experts or over all, times any constant (moe.router read as other: a softmax of
    the chosen probabilities, an activation applied twice), that claim does not hold either, and differs."""
    if card.value("moe.router") != "other":
        return verdicts
    unread = [v for v in verdicts if v.key in ("moe.renorm", "moe.scale") and v.status == "unread"]
    return _settled(verdicts, unread, "differs", "no softmax or sigmoid of the router's outputs, over the chosen or over "
                                                 "all, fits the routing weights")


def _settled(verdicts, unread: list, status: str, measured=None) -> tuple:
    """verdicts with those of `unread` judged after all: match (measured as claimed) or differs (measured, a sentence)."""
    return tuple(dataclasses.replace(v, status=status, measured=v.claimed if measured is None else measured, why=None)
                 if v in unread else v for v in verdicts)


def _norm_module_contradicts(ctx: Context, claim) -> bool:
    """Whether a norm module of the block written outside torch, read alone on a float64 copy at its own width, does
    not do what it says: one whose class name says RMSNorm subtracting the mean, or LayerNorm (with a bias) not
    subtracting it (norm.kind), one computing with another floor than the eps it keeps (norm.eps)."""
    import torch

    from tblock_cli.card.norms import EPS_TOL, eps, kind, unit_tokens
    from tblock_cli.card.own import ON_NORM, is_layer_norm, is_rms_name, own_norm
    from tblock_cli.checks.training import all_modules

    for m in all_modules(ctx.subject.module):
        w = getattr(m, "weight", None)
        if not own_norm(m) or not isinstance(w, torch.Tensor) or w.ndim != 1:
            continue
        kept = next((vars(m)[a] for a in ON_NORM if isinstance(vars(m).get(a), float)), None)
        said = "rmsnorm" if is_rms_name(type(m).__name__) else "layernorm" if is_layer_norm(m) else None
        if (claim.key == "norm.kind" and said != claim.value) or (claim.key == "norm.eps" and not kept):
            continue
        try:
            twin = module_copy(m).to(dtype=torch.float64)
            v = torch.randn(1, 4, w.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            v = unit_tokens(v).to(w.device)
            if claim.key == "norm.kind" and kind(twin, v)[0] not in (said, None):
                return True
            got = eps(twin, v)[0] if claim.key == "norm.eps" else None
            if got is not None and abs(got - kept) > EPS_TOL * kept:
                return True
        except Exception:  # noqa: BLE001 - a norm that cannot be called alone is no evidence
            continue
    return False


def _rotary_that_runs(ctx: Context) -> str | None:
    """The first module of the block whose class says rotary (or RoPE) that runs in an eval forward; None where none
    does, or for a layer of a model (whose rotary module runs once for every layer, a layer without positions too)."""
    from tblock_cli.card.own import is_rotary_name
    from tblock_cli.checks.context import eval_forward

    module = ctx.subject.module
    if type(module).__name__ == "ModelLayers":
        return None
    rotary = [(n, m) for n, m in module.named_modules() if n and is_rotary_name(type(m).__name__)]
    if not rotary:
        return None
    ran: list[str] = []
    hooks = [m.register_forward_hook(lambda _m, _a, _o, n=n: ran.append(n)) for n, m in rotary]
    try:
        eval_forward(ctx, ctx.x())
    finally:
        for h in hooks:
            h.remove()
    return ran[0] if ran else None


def check_like_reference(ctx: Context) -> Outcome:
    """The block computes what the --like layer computes with the same weights (outputs, gradients, decoding).

    Catches: with `--like hf:TYPE`: the block against that Hugging Face layer with its weights carried (as `tblock
    compare` carries them): outputs or gradients that differ, the first differing component named; skips where the
    weights cannot be carried"""
    decl = ctx.declaration
    if decl is None or decl.like is None:
        return skipped("like_reference.undeclared")
    if decl.compared is None:
        return skipped("like_reference.not_compared", like=decl.like, why=decl.compare_error or "the comparison did not run")
    report = decl.compared
    worst = [c for c in report.comparisons if not c.equal]
    first = report.first_difference
    facts = {"like": decl.like, "differ": [c.name for c in worst],
             "rel": max((c.rel for c in worst), default=max((c.rel for c in report.comparisons), default=0.0)),
             "first": first.text if first is not None else None,
             "findings": [f.text for f in report.findings if f.status.value in ("fail", "warn")]}
    if not report.ok and first is not None and "rotary" in first.facts:
        # The same architecture with the other rotary pairing (Meta's interleaved against HF's half-split): a weight
        # layout convention, not a computation the random-weight block gets wrong; the spec check judges the rest.
        return passed("like_reference.rotary_layout", facts["rel"], rotary=first.facts["rotary"], **facts)
    if not report.ok:
        return failed("like_reference.differs", facts["rel"], **facts)
    # The same computation once one-sided parameters were set aside (a bias the other side lacks zeroed, a norm's
    # weight left at ones against a weight-free norm): the block's parameters are not the reference's. It would
    # train other parameters, and the reference's checkpoint leaves some of them at their initial values.
    extra, lacking = _one_sided(report)
    facts.update(extra=extra, lacking=lacking)
    if extra or lacking:
        return failed("like_reference.params_differ", facts["rel"], **facts)
    return passed("like_reference.same", facts["rel"], **facts)


def _one_sided(report) -> tuple[list[str], list[str]]:
    """Parameters of the block (A) the reference lacks, and the reference's (B) the block lacks, that the comparison
    set aside (zeroed or left at their identity values); a bias whose values change nothing (a key bias) is not one."""
    sides = {"A": [], "B": []}
    for f in report.findings:
        if f.kind in ("mapping.bias_zeroed", "mapping.at_init") and not f.facts.get("inert"):
            sides[f.facts["side"]].append(f.facts["param"])
    return sides["A"], sides["B"]
