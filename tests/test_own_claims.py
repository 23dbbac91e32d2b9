"""The `spec` check without a declaration: what a block says of itself (constructor arguments, configs, attributes)
held against its card. Planted contradictions of tests/zoo_claims.py caught and named, the twins that honour what
they say passing, and the reading rules: arguments before attributes, a key given two values claims nothing, only
names whose meaning is not in doubt."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch.nn as nn
import zoo_claims
import zoo_classes
import zoo_families
import zoo_framework_names
import zoo_routing
import zoo_sizes
import zoo_stretch
import zoo_switches
import zoo_tables

import tblock_cli
from tblock_cli.card.own import FRACTION, own_claims
from tblock_cli.card.own_causal import own_causal
from tblock_cli.card.own_fit import with_fraction
from tblock_cli.card.own_names import DYNAMIC, RENORM_OFF
from tblock_cli.checks import Status

from conftest import TESTS


def spec_check(name, d_model=32, zoo="zoo_claims.py", **flags):
    spec = f"{TESTS / zoo}:{name}"
    return tblock_cli.check(spec, d_model=d_model, n_heads=4, causal=True, threads=1, only="spec", **flags).checks[0]


ZOOS = {"zoo_claims.py": zoo_claims, "zoo_tables.py": zoo_tables, "zoo_sizes.py": zoo_sizes, "zoo_switches.py": zoo_switches,
        "zoo_framework_names.py": zoo_framework_names, "zoo_stretch.py": zoo_stretch, "zoo_routing.py": zoo_routing,
        "zoo_classes.py": zoo_classes, "zoo_families.py": zoo_families}


@pytest.mark.parametrize("zoo, name", [(z, n) for z, m in ZOOS.items() for n in sorted(m.PLANTED)])
def test_a_block_that_contradicts_itself_fails_naming_the_entry(zoo, name):
    c = spec_check(name, zoo=zoo)
    assert c.status is Status.FAIL and c.kind == "spec.not_like", c
    want = ZOOS[zoo].PLANTED[name]
    assert [d["key"] for d in c.facts["differs"]] == (list(want) if isinstance(want, tuple) else [want])
    assert c.facts["own"] and "the block's own" in c.facts["differs"][0]["source"]


@pytest.mark.parametrize("zoo, name", [(z, n) for z, m in ZOOS.items() for n in m.CORRECT])
def test_a_block_that_honours_what_it_says_passes(zoo, name):
    c = spec_check(name, zoo=zoo)
    assert c.status is Status.PASS and c.kind == "spec.matches" and c.facts["matched"] >= 1, c


def test_the_rotary_base_asked_for_is_the_one_judged():
    c = spec_check("RotaryBaseIgnored")
    (d,) = c.facts["differs"]
    assert d["claimed"] == 500000.0 and d["measured"] == pytest.approx(10000.0, rel=1e-3)
    assert "`rope_theta`" in d["source"]


def test_a_declaration_replaces_what_the_block_says():
    c = spec_check("RotaryBaseIgnored", expect=["rope.theta=10000"])
    assert c.status is Status.PASS and not c.facts["own"]


def test_reading_rules():
    class RotaryEmbedding(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

    class Mixer(nn.Module):  # not an attention module: its `scale` is not a score scale
        def __init__(self):
            super().__init__()
            self.scale = 0.5

    @dataclass
    class Config:
        rope_theta: float = 1e6
        hidden_act: str = "gelu_pytorch_tanh"
        softcap: float | None = None  # off: nothing to hold against the card

    def claims(modules, arguments=None):
        return {c.key: c.value for c in own_claims(modules, arguments)}

    # an argument speaks before a module's attribute; configs are read field by field
    assert claims([RotaryEmbedding(1e4)], {"config": Config()}) == {"rope.theta": 1e6, "ffn.act": "gelu_tanh"}
    assert claims([RotaryEmbedding(1e4)]) == {"rope.theta": 1e4}
    # two values for one key in the same tier: nothing claimed
    assert claims([RotaryEmbedding(1e4), RotaryEmbedding(5e5)]) == {}
    # `base` only on a rotary module, `scale` only on an attention module
    assert claims([Mixer()]) == {}
    m = nn.Module()
    m.base = 10000.0
    assert claims([m]) == {}
    # an activation named as a word claims it; a callable (nn.TransformerEncoderLayer's F.relu) claims nothing
    assert claims([], {"activation": "gelu"}) == {"ffn.act": "gelu"} and claims([], {"activation": nn.functional.relu}) == {}
    # a rotary scaling dict: linear, llama3 and yarn with their factor; dynamic its original length only (0: unknown)
    assert claims([], {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == {"rope.scaling": "llama3", "rope.factor": 8.0}
    assert claims([], {"rope_scaling": {"type": "dynamic", "factor": 2.0}}) == {DYNAMIC: 0}
    # a residual switch names the form either way
    assert claims([], {"use_parallel_residual": False}) == {"residual.form": "sequential"}
    assert claims([], {"parallel_attn": True}) == {"residual.form": "parallel"}
    # a renormalisation asked for claims it; False, many configs' default (litgpt's for Mixtral, whose router
    # renormalises by construction), claims nothing by itself: only beside a family whose code reads it
    # (card/own_fit.py with_renorm_off, tests/test_routing_groups.py)
    assert claims([], {"norm_topk_prob": True}) == {"moe.renorm": True}
    assert claims([], {"norm_topk_prob": False}) == {RENORM_OFF: True}

    @dataclass
    class TwoBases:  # Gemma-3: sliding layers rotate at 10000, global ones at 1e6
        rope_theta: float = 1e6
        rope_local_base_freq: float = 1e4

    assert claims([], {"config": TwoBases()}) == {} and claims([], {"config": Config()})["rope.theta"] == 1e6


def test_reading_rules_for_litgpt_megatron_and_falcon_names():
    def claims(**arguments):
        return {c.key: c.value for c in own_claims([], arguments)}

    # class names as configs write them: only the known ones claim (litgpt's MoE classes say nothing of gating)
    assert claims(norm_class_name="RMSNorm", mlp_class_name="GptNeoxMLP") == {"norm.kind": "rmsnorm", "ffn.gated": False}
    assert claims(normalization="LayerNorm", mlp_class_name="LLaMAMoE") == {"norm.kind": "layernorm"}
    assert claims(normalization=nn.BatchNorm2d(3)) == {}  # a module kept under the name claims nothing
    assert claims(gated_linear_unit=True) == {"ffn.gated": True}
    # Megatron's query groups are the key/value heads: the ratio and the grouped layout, as num_key_value_heads
    assert claims(num_attention_heads=8, num_query_groups=2) == {"attn.heads": 8.0, "attn.group": 4.0,
                                                                 "attn.kv_grouping": "contiguous"}
    assert claims(alibi=True) == {"pos.kind": "alibi"} and claims(alibi=False) == {}  # Falcon's switch, True only
    # a scaling dict that names no type: llama-3's by its keys (gpt-fast, litgpt), a factor alone nothing
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
    assert claims(rope_adjustments=llama3) == {"rope.scaling": "llama3", "rope.factor": 8.0,
                                               "rope.low_freq_wavelen": 8192.0, "rope.high_freq_wavelen": 2048.0}
    assert claims(rope_scaling={"factor": 2.0}) == {}
    # litgpt's GELU switch: "tanh" claims the approximation, "none" nothing
    assert claims(gelu_approximate="tanh") == {"ffn.act": "gelu_tanh"} and claims(gelu_approximate="none") == {}


def test_a_rotating_fraction_becomes_rope_dims_of_the_measured_head():
    claims = own_claims([], {"partial_rotary_factor": 0.25})
    (fraction,) = [c for c in claims if c.key == FRACTION]
    assert fraction.key == FRACTION and fraction.value == 0.25
    # and the head's first channels, as every transformers family with a partial rotation turns them
    assert {(c.key, c.value) for c in claims if c.key != FRACTION} == {("rope.place", "first")}
    # not beside multi-head latent attention's widths: its rope part comes last
    assert "rope.place" not in {c.key for c in own_claims([], {"rotary_dim": 8, "qk_rope_head_dim": 8})}
    assert [(c.key, c.value) for c in with_fraction((fraction,), 64)] == [("rope.dims", 16.0)]
    assert with_fraction((fraction,), None) == ()  # the head's width unread: nothing to hold it against


def test_a_rotary_module_that_runs_and_never_reaches_the_scores_names_what_the_card_reads():
    dropped, queries = spec_check("RotaryDropped"), spec_check("RotaryOnQueries")
    assert [(d["measured"], d["claimed"]) for d in dropped.facts["differs"]] == [("none", "rotary")]
    assert [(d["measured"], d["claimed"]) for d in queries.facts["differs"]] == [("other", "rotary")]
    assert "`rotary`" in dropped.facts["differs"][0]["source"]


def causal_check(name, **flags):
    spec = f"{TESTS / 'zoo_claims.py'}:{name}"
    return tblock_cli.check(spec, d_model=32, n_heads=4, threads=1, only="causal", **flags).checks[0]


@pytest.mark.parametrize("name", zoo_claims.SAID_CAUSAL)
def test_a_block_that_says_it_is_causal_is_held_to_it_without_the_flag(name):
    c = causal_check(name)
    assert c.status is Status.FAIL and c.kind == "causal.leak", c
    assert c.facts["claimed"] and "the block says it is causal" in c.detail


@pytest.mark.parametrize("name", zoo_claims.SAID_CAUSAL_CORRECT)
def test_a_causal_block_that_says_so_passes_without_the_flag(name):
    c = causal_check(name)
    assert c.status is Status.PASS and c.kind == "causal.respected" and c.facts["claimed"], c


def test_a_block_that_does_not_say_it_is_causal_is_not_held_to_it():
    # the same block built with causal=False says nothing: the check answers as before, not asked for
    c = causal_check("MaskForgotten", kwargs={"causal": False})
    assert c.status is Status.SKIP and c.kind == "causal.not_asked" and not c.facts["causal_by_itself"]
    assert tblock_cli.check(None, d_model=32, n_heads=4, threads=1, only="causal").checks[0].kind == "causal.not_asked"


def test_causality_reading_rules():
    class CausalSelfAttention(nn.Module):
        pass

    class NonCausalAttention(nn.Module):
        pass

    def flagged(name, value):
        m = nn.Module()
        setattr(m, name, value)
        return m

    # arguments (and their configs) first; only True is a claim; a False argument silences the lower tiers
    assert "`causal=True`" in own_causal([flagged("is_causal", False)], {"causal": True})
    assert own_causal([flagged("is_causal", True)], {"causal": False}) is None
    # attributes next, all of them agreeing; two values claim nothing
    assert "is_causal = True" in own_causal([flagged("is_causal", True), CausalSelfAttention()])
    assert own_causal([flagged("causal", True), flagged("is_causal", False)]) is None
    assert own_causal([flagged("causal", "yes")]) is None  # not a switch
    # an attention module's class name last
    assert "CausalSelfAttention" in own_causal([nn.Module(), CausalSelfAttention()])
    assert own_causal([NonCausalAttention()]) is None


def test_head_counts_claim_their_ratio_not_the_counts():
    """Differential attention doubles both counts in the product (8 query heads over 4 key heads for 4 over 2):
    the ratio holds; a kept num_key_value_heads that never reached the projections does not."""
    for name, heads in (("GroupedQuery", 4), ("DifferentialHeads", 8)):
        card = tblock_cli.spec(f"{TESTS / 'zoo_claims.py'}:{name}", d_model=32, n_heads=4, threads=1).card
        assert (card.value("attn.heads"), card.value("attn.group")) == (heads, 2.0), name
        assert spec_check(name).status is Status.PASS
    c = spec_check("KVHeadsIgnored")
    (d,) = c.facts["differs"]
    assert (d["claimed"], d["measured"]) == (2.0, 1.0) and "num_key_value_heads" in d["source"]


def test_head_count_reading_rules():
    @dataclass
    class Config:
        num_attention_heads: int = 8
        num_kv_heads: int = 8
        multi_query: bool = False

    class Layer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    def group(config, **kept):
        layer = Layer(config)
        vars(layer).update(kept)
        return next((c.value for c in own_claims([layer], {}) if c.key == "attn.group"), None)

    assert group(Config()) == 1.0 and group(Config(num_kv_heads=2)) == 4.0
    assert group(Config(num_kv_heads=2, multi_query=True)) is None  # Falcon: multi_query overrides the kept count
    assert group(Config(num_kv_heads=3)) is None  # not a whole ratio: claims nothing
    assert group(None, n_heads=8, n_rep=2) == 2.0  # Meta's llama keeps the group size itself
    assert group(None, n_heads=8, n_kv_heads=2, n_rep=2) is None  # 4 and 2: counts that disagree claim nothing


def test_sizes_reading_rules():
    """Query heads claim attn.heads, met by a whole multiple (differential attention splits each head in two); an FFN
    width claims ffn.hidden from a config only, by its unambiguous names, and not where it gives another beside it;
    the width is judged only against a dense FFN whose curve the card fitted."""
    from tblock_cli.card.entries import Card, Entry, judge
    from tblock_cli.card.own_fit import fitted

    @dataclass
    class Config:
        num_attention_heads: int = 8
        intermediate_size: int = 2048
        moe_intermediate_size: int | None = None

    def claims(cfg=None, **args):
        layer = nn.Module()
        layer.config = cfg
        return {c.key: c for c in own_claims([layer], args)}

    got = claims(Config())
    assert got["attn.heads"].value == 8.0 and got["ffn.hidden"].value == 2048.0
    assert "ffn.hidden" not in claims(Config(moe_intermediate_size=512))  # which width a layer uses is the layer's
    assert "ffn.hidden" not in claims(None, d_ff=96)  # an argument may be tblock's own --d-ff, sized the block's way
    assert claims(None, config=Config(intermediate_size=96))["ffn.hidden"].value == 96.0  # a config's is the width

    def verdict(measured, claim):
        return judge(Card("x", (Entry("attn.heads", measured),)), (claim,))[0].status

    heads = got["attn.heads"]
    assert [verdict(m, heads) for m in (8, 16, 4, 12)] == ["match", "match", "differs", "differs"]
    assert verdict(16, dataclasses.replace(heads, multiple=False)) == "differs"  # --expect's count is exact

    def kept(**entries):
        card = Card("x", tuple(Entry(k, v) for k, v in entries.items()))
        return [c.key for c in fitted((got["ffn.hidden"],), card, 513)]

    assert kept(**{"ffn.act": "silu", "moe.experts": 0}) == ["ffn.hidden"]
    assert kept(**{"ffn.act": "silu", "moe.experts": 8}) == []  # an expert's width is another
    assert kept(**{"ffn.act": "other", "moe.experts": 0}) == []  # a Mamba mixer read as an FFN (hf:jamba)


def test_layer_scale_reading_rules():
    """LayerScale's start claims both branch gains; timm's plain `init_values` only as a constructor argument; a switch
    beside it set False (FocalNet's use_layerscale) claims nothing; a start of 1 claims nothing."""
    @dataclass
    class Config:
        layerscale_value: float = 1e-4
        use_layerscale: bool = True

    def gains(config=None, kept=None, **args):
        layer = nn.Module()
        layer.config = config
        vars(layer).update(kept or {})
        return {c.key: c.value for c in own_claims([layer], args) if c.key.startswith("residual.")}

    assert gains(Config()) == {"residual.attn_gain": 1e-4, "residual.ffn_gain": 1e-4}
    assert gains(Config(use_layerscale=False)) == {}
    assert gains(init_values=0.1) == {"residual.attn_gain": 0.1, "residual.ffn_gain": 0.1}
    assert gains(kept={"init_values": 0.1}) == {}  # an attribute of that name may be anything
    assert gains(Config(layerscale_value=1.0)) == {}


def test_a_table_whose_frequencies_repeat_is_read_not_raised_on():
    """A cat(f, f) table read with interleaved pairs turns its pairs at f0, f0, f2, f2, ...: the theta fit over the
    leading pairs found no slope (theta 1) and the llama-3 ramp's fit divided by zero, so at d_head 16 the claim went
    unjudged ("could not be read"). Such a table is no theta^(-2i/dims) one: `other`, and the base it says is judged."""
    from tblock_cli.card.rope_table import scaling_reading

    f = [10000.0 ** (-2 * k / 16) for k in range(0, 8, 2)]
    reading = scaling_reading([v for v in f for _ in (0, 1)], 16)
    assert reading["scaling"] == "other" and reading["theta"] == pytest.approx(1.0)
    c = spec_check("CatTableInterleaved", d_model=64, zoo="zoo_tables.py")
    assert c.status is Status.FAIL and [d["key"] for d in c.facts["differs"]] == ["rope.theta"], c


def test_a_cap_without_its_division_fails_where_the_attention_check_cannot_read_the_scale():
    """cap * tanh(s): the cap holds, so the claimed softcap matches; the logits' spread under tanh tells the attention
    check nothing, and the card's slope at small logits is 20x 1/sqrt(d_head), the cap's own value: failed. A slope
    off by another factor (sqrt(d_head): the 1/sqrt(d_head) left out under a divided cap) is warned, as the attention
    check warns unscaled scores. Twin: cap * tanh(s / cap)."""
    c = spec_check("SoftcapNotDivided", zoo="zoo_tables.py")
    assert c.status is Status.FAIL and c.kind == "spec.cap_not_divided" and c.facts["ratio"] == pytest.approx(20, rel=1e-3), c
    c = spec_check("SoftcapUnscaled", zoo="zoo_tables.py")
    assert c.status is Status.WARN and c.kind == "spec.capped_scale" and c.facts["ratio"] == pytest.approx(8 ** 0.5, rel=1e-3), c
    assert spec_check("SoftcapApplied").kind == "spec.matches"


def test_a_block_built_bidirectional_that_is_exactly_causal_is_warned():
    """`causal=False` as a constructor argument, and no output reads a later position while the last reads earlier
    ones: the argument never reached the mask. Twin: the same block honouring it; a block mixing no tokens at all says
    nothing by being causal, and a kept attribute False is no claim (a mask may be passed in)."""
    def causal_check(name):
        return tblock_cli.check(f"{TESTS / 'zoo_construction.py'}:{name}", d_model=32, n_heads=4, threads=1,
                                only="causal").checks[0]

    c = causal_check("CausalArgumentIgnored")
    assert c.status is Status.WARN and c.kind == "causal.said_bidirectional", c
    assert c.facts["said"] == "constructor argument `causal=False`"
    assert causal_check("CausalArgumentHonoured").kind == "causal.not_asked"


def test_a_scale_the_block_says_it_applies_is_not_warned_and_one_it_contradicts_is():
    """Granite's muP scale 1/d_head, kept as `attention_multiplier`, is the block's design: `attention` passes it
    (0.27x what 1/sqrt(d_head) predicts, the claim predicts 0.25x); a scale module keeping 1/sqrt(d_head) and dividing
    by sqrt(d_model) is still warned (0.5x, the claim predicts 1x)."""
    def attention(zoo, name):
        return tblock_cli.check(f"{TESTS / zoo}:{name}", d_model=64, n_heads=4, causal=True, threads=1,
                                only="attention").checks[0]

    honoured = attention("zoo_tables.py", "GraniteMultipliers")
    assert honoured.status is Status.PASS and honoured.kind == "attention.declared_scale", honoured
    assert honoured.facts["declared"] == pytest.approx(256.0) and "attention_multiplier" in honoured.facts["source"]
    contradicted = attention("zoo_claims.py", "ScaleAttributeContradicted")
    assert contradicted.status is Status.WARN and contradicted.kind == "attention.overscaled", contradicted


def test_a_kv_head_count_claims_the_grouped_layout_and_no_count_claims_none():
    """num_key_value_heads below the query heads claims attn.group and the one layout grouped-query attention has
    (query head h reads key head h // group); equal counts group nothing and claim no layout."""
    grouped = {c.key: c.value for c in own_claims([zoo_claims.GroupedQuery(32, 4, 2)], {})}
    assert (grouped["attn.group"], grouped["attn.kv_grouping"]) == (2.0, "contiguous")
    full = {c.key for c in own_claims([zoo_claims.GroupedQuery(32, 4, 4)], {})}
    assert "attn.kv_grouping" not in full


def test_head_dim_claims_the_head_width_except_beside_latent_attention_widths_or_on_torch_modules():
    """A kept head_dim claims attn.head_dim; beside DeepSeek's MLA widths (its config's head_dim is the rotary part
    alone) it claims nothing, and nn.MultiheadAttention's own head_dim (computed with by construction) neither."""
    import torch

    class Attn(nn.Module):
        def __init__(self, **widths):
            super().__init__()
            self.head_dim = 32
            vars(self).update(widths)

    def claimed(m):
        return {c.key: c.value for c in own_claims([m], {})}.get("attn.head_dim")

    assert claimed(Attn()) == 32.0
    litgpt = Attn()
    del litgpt.head_dim
    litgpt.head_size = 48  # litgpt's name for it
    assert claimed(litgpt) == 48.0
    assert claimed(Attn(qk_rope_head_dim=32, qk_nope_head_dim=64)) is None
    assert claimed(torch.nn.MultiheadAttention(64, 4)) is None


def test_a_scaled_rotary_table_float16_rounds_is_not_judged_in_float16():
    """Llama 3.1's table at theta 5e5 and factor 8 has slow frequencies near 1e-6 per position, below float16's normal
    range (6.1e-5): a float16 run holds them rounded, so its scaling and band read as another table. They are left
    unread there; float32 still judges them, and the band built from the wrong length still fails."""
    half = spec_check("Llama3Scaled", d_model=64, zoo="zoo_tables.py", dtype="float16")
    assert half.status is Status.PASS and {"rope.scaling", "rope.low_freq_wavelen"} <= set(half.facts["unread_keys"]), half
    assert spec_check("Llama3Scaled", d_model=64, zoo="zoo_tables.py").facts["unread_keys"] == []
    assert spec_check("Llama3OriginalFromMax", d_model=64, zoo="zoo_tables.py").status is Status.FAIL
