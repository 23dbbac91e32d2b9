"""The spec card's attention and position entries: read off Hugging Face layers they equal the layer's config; planted
wrong in a user-written block, each is named by the declared spec check; the correct twin passes."""

from pathlib import Path

import pytest
import torch
from spec_blocks_attn import t5_bucket

from tblock_cli.api import check, spec
from tblock_cli.card.entries import Card, Claim, judge
from tblock_cli.checks.positions import paper_slopes

BLOCK = f"{Path(__file__).parent / 'spec_blocks_attn.py'}:Block"
SIZES = {"d_model": 64, "n_heads": 4, "threads": 1}
HF_SIZES = {**SIZES, "d_ff": 128}
# With the other tests that build Hugging Face layers (tests/test_hf.py): transformers and the dynamo it pulls in
# (~3 s) are imported on one worker only.
HF = pytest.mark.xdist_group("hf")


def card(block, kwargs=None, **sizes):
    r = spec(block, kwargs=kwargs, **{**(HF_SIZES if block.startswith("hf:") else SIZES), **sizes})
    return r.card, r


def config_of(report_card, block, kwargs=None, **sizes):
    """The hf layer's own config (the model tblock built), read through its setup."""
    from tblock_cli.subject.setup import setup

    s = setup(block, {**HF_SIZES, **sizes, **({"kwargs": kwargs} if kwargs else {})}, trains=False)
    with s.session():
        return s.make().module.config


def close(a, b, tol):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def plain_freqs(theta, dims):
    return [theta ** (-2 * i / dims) for i in range(dims // 2)]


def steps(T, bidirectional, causal):
    """j - i where T5's bucket of key - query changes from the next distance toward the query."""
    rel = torch.arange(-(T - 1), T)
    b = t5_bucket(rel, bidirectional)
    return tuple(o for o in range(-(T - 1), T) if o != 0 and not (causal and o > 0)
                 and b[o + T - 1] != b[o + T - 1 + (1 if o < 0 else -1)])


# ---------------------------------------------------------------- card == config, per Hugging Face family
LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
          "max_position_embeddings": 131072}


@HF
@pytest.mark.parametrize("interleave", [True, False])
def test_the_pairing_is_read_in_the_projections_channels(interleave):
    """HF's DeepSeek-V3 with rope_interleave de-interleaves q before a rotate-half: half-split pairs at the product,
    (2i, 2i + 1) in q_b_proj's channels. The card reads the pairing in the weights' layout: its config's switch."""
    pytest.importorskip("transformers")
    c, _ = card("hf:deepseek_v3", {"rope_interleave": interleave})
    assert config_of(c, "hf:deepseek_v3", {"rope_interleave": interleave}).rope_interleave is interleave
    e = c.get("rope.pairing")
    assert e.value == ("interleaved" if interleave else "half"), e
    assert ("permuted" in e.how) is interleave, e.how


@HF
@pytest.mark.parametrize("kwargs", [None, LLAMA3], ids=["plain", "llama3"])
def test_llama_rotary_and_scale_equal_config(kwargs):
    pytest.importorskip("transformers")
    c, _ = card("hf:llama", kwargs)
    cfg = config_of(c, "hf:llama", kwargs)
    rp = cfg.rope_parameters
    hd = cfg.hidden_size // cfg.num_attention_heads
    assert c.value("pos.kind") == "rotary" and c.value("rope.dims") == hd and c.value("rope.pairing") == "half"
    assert close(c.value("rope.theta"), rp["rope_theta"], 1e-3)
    assert (c.value("attn.heads"), c.value("attn.kv_heads"), c.value("attn.head_dim")) == \
        (cfg.num_attention_heads, cfg.num_key_value_heads, hd)
    assert close(c.value("attn.scale"), hd, 1e-6) and c.value("attn.softcap") == "none" and c.value("attn.causal") is True
    assert c.value("attn.qk_norm") == "none" and c.value("attn.window") == "none"
    plain = plain_freqs(rp["rope_theta"], hd)
    if kwargs is None:
        assert c.value("rope.scaling") == "none" and c.value("rope.factor") == 1
        assert all(close(a, b, 1e-5) for a, b in zip(c.value("rope.freqs"), plain))
    else:  # the llama-3 table from its own formula (tests/spec_blocks_attn.py: Meta's)
        from spec_blocks_attn import llama3_freqs

        want = llama3_freqs(torch.tensor(plain, dtype=torch.float64), rp["factor"], rp["low_freq_factor"],
                            rp["high_freq_factor"], rp["original_max_position_embeddings"]).tolist()
        assert all(close(a, b, 1e-5) for a, b in zip(c.value("rope.freqs"), sorted(want, reverse=True)))
        assert c.value("rope.scaling") == "llama3" and close(c.value("rope.factor"), rp["factor"], 1e-4)


@HF
def test_mistral_window_equals_config():
    pytest.importorskip("transformers")
    kw = {"sliding_window": 12}
    c, _ = card("hf:mistral", kw)
    assert c.value("attn.window") == config_of(c, "hf:mistral", kw).sliding_window


@HF
def test_gemma2_softcap_and_query_scalar_equal_config():
    pytest.importorskip("transformers")
    kw = {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 30.0}
    c, _ = card("hf:gemma2", kw)
    cfg = config_of(c, "hf:gemma2", kw)
    assert close(c.value("attn.scale"), cfg.query_pre_attn_scalar, 1e-4)
    assert close(c.value("attn.softcap"), cfg.attn_logit_softcapping, 1e-6)


@HF
@pytest.mark.parametrize("family", ["gpt_neox", "phi"])
def test_partial_rotary_equals_config(family):
    pytest.importorskip("transformers")
    c, _ = card("hf:" + family)
    cfg = config_of(c, "hf:" + family)
    rp = cfg.rope_parameters
    rot = int(cfg.hidden_size // cfg.num_attention_heads * rp["partial_rotary_factor"])
    assert c.value("rope.dims") == rot
    assert close(c.value("rope.theta"), rp["rope_theta"], 1e-3)
    assert all(close(a, b, 1e-5) for a, b in zip(c.value("rope.freqs"), plain_freqs(rp["rope_theta"], rot)))


@HF
@pytest.mark.parametrize("family,axis", [("qwen3", "head"), ("olmo2", "width")])
def test_qk_norm_axis_equals_the_family(family, axis):
    pytest.importorskip("transformers")
    c, _ = card("hf:" + family)
    assert c.value("attn.qk_norm") == axis


@HF
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_t5_buckets_equal_config(stack):
    pytest.importorskip("transformers")
    kw = {"stack": stack} if stack == "decoder" else None
    c, _ = card("hf:t5", kw)
    cfg = config_of(c, "hf:t5", kw)
    assert (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance) == (32, 128)  # t5_bucket's
    causal = stack == "decoder"
    assert c.value("pos.kind") == "relative_bias" and c.value("attn.causal") is causal
    assert c.value("relbias.steps") == steps(48, not causal, causal)
    assert c.value("relbias.bidirectional") is (None if causal else True)
    assert close(c.value("attn.scale"), 1.0, 1e-6)  # T5 folds 1/sqrt(d_head) into its init


@HF
@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_slopes_equal_the_papers(family):
    pytest.importorskip("transformers")
    c, _ = card("hf:" + family)
    assert c.value("pos.kind") == "alibi"
    assert all(close(a, b, 1e-6) for a, b in zip(c.value("alibi.slopes"), paper_slopes(4)))


@HF
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_layers_without_positions_read_none(family):
    pytest.importorskip("transformers")
    c, _ = card("hf:" + family)
    assert c.value("pos.kind") == "none" and c.value("attn.causal") is (family == "gpt2")


# ---------------------------------------------------------------- planted variants, caught by the declared check
def spec_check(kwargs, expect):
    r = check(BLOCK, kwargs=kwargs, expect=expect, only=["spec"], **SIZES)
    return r.checks[0]


TWIN = {"theta": 500000.0, "rot_dims": 8, "softcap": 30.0, "window": 8, "qk_norm": "head", "scale_x": 24}
CLAIMS = ["rope.theta=500000", "rope.dims=8", "rope.scaling=none", "rope.pairing=half", "attn.scale=24",
          "attn.softcap=30", "attn.window=8", "attn.qk_norm=head", "attn.causal=true", "pos.kind=rotary"]
PLANTED = {  # the bug -> the entry the check must name
    "theta ignored": ({"theta": 10000.0}, "rope.theta"),
    "every dim rotates": ({"rot_dims": None}, "rope.dims"),
    "frequencies over the head width": ({"freq_width": 16}, "rope.theta"),
    "interleaved pairs": ({"pairing": "complex"}, "rope.pairing"),
    "scale 1/sqrt(head dim)": ({"scale_x": None}, "attn.scale"),
    "soft-cap missing": ({"softcap": None}, "attn.softcap"),
    "window off": ({"window": None}, "attn.window"),
    "q/k-norm over the width": ({"qk_norm": "width"}, "attn.qk_norm"),
    "not causal": ({"causal": False}, "attn.causal"),
}


def test_correct_twin_passes():
    c = spec_check(TWIN, CLAIMS)
    assert c.status.value == "pass", c.facts


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_entry_is_named(name):
    change, key = PLANTED[name]
    c = spec_check({**TWIN, **change}, CLAIMS)
    assert c.status.value == "fail" and key in [d["key"] for d in c.facts["differs"]], c.facts


LLAMA3_BLOCK = {"theta": 500000.0, "llama3": [8.0, 1.0, 4.0, 256]}  # a short original length: two pairs kept, one in the band, five scaled at 16 dims


def test_llama3_scaling_discarded_is_named():
    good = spec_check(LLAMA3_BLOCK, ["rope.scaling=llama3", "rope.factor=8"])
    assert good.status.value == "pass", good.facts
    bad = spec_check({**LLAMA3_BLOCK, "apply_scaling": False}, ["rope.scaling=llama3", "rope.factor=8"])
    assert {d["key"] for d in bad.facts["differs"]} == {"rope.scaling", "rope.factor"}, bad.facts


@pytest.mark.parametrize("llama3", [False, True])
def test_a_table_kept_in_bfloat16_reads_its_scaling(llama3):
    # cos/sin rounded to bfloat16 in a float32 block (modded-nanogpt): each frequency ratio scatters by ~3e-3, which the
    # float32 tolerance (1e-3) read as "other"; the table's own wobble widens it, no further than a bfloat16 run's
    block = {**(LLAMA3_BLOCK if llama3 else {"theta": 500000.0}), "table_dtype": "bfloat16"}
    c, _ = card(BLOCK, kwargs=block)
    assert c.value("rope.scaling") == ("llama3" if llama3 else "none"), c
    assert close(c.value("rope.factor"), 8.0 if llama3 else 1.0, 0.02) and close(c.value("rope.theta"), 5e5, 0.02)
    if llama3:  # the scaling still tells from none at that tolerance
        unscaled, _ = card(BLOCK, kwargs={**block, "apply_scaling": False})
        assert unscaled.value("rope.scaling") == "none", unscaled


def test_attention_over_batch_times_heads_is_read_per_head():
    # ESM-2 and fairseq run bmm over (B * H, T, d_head): read as B samples of H heads, as transformers lay them out
    # (every attention entry was unread before); the scale is folded into q before a rotate-half rotary
    from zoo_layouts import ScaledBeforeRotateHalf

    r = spec(ScaledBeforeRotateHalf(64, 4), **SIZES)
    c = r.card
    assert (c.value("attn.heads"), c.value("attn.head_dim"), c.value("attn.kv_heads")) == (4, 16, 4), c
    assert close(c.value("attn.scale"), 16, 0.03) and c.value("pos.kind") == "rotary", c
    assert c.value("rope.pairing") == "half" and close(c.value("rope.theta"), 1e4, 0.02), c
    unscaled = spec(ScaledBeforeRotateHalf(64, 4, scaled=False), **SIZES).card
    assert close(unscaled.value("attn.scale"), 1, 0.03), unscaled


def test_bidirectional_buckets_in_a_decoder_are_named():
    claim = ["relbias.steps=" + ",".join(str(o) for o in steps(48, False, True)), "pos.kind=relative_bias"]
    base = {"rope": False, "relbias": False, "scale_x": 1}
    assert spec_check(base, claim).status.value == "pass"
    bad = spec_check({**base, "relbias": True}, claim)
    assert [d["key"] for d in bad.facts["differs"]] == ["relbias.steps"], bad.facts


def test_alibi_slopes_planted():
    good = spec_check({"rope": False, "alibi": True}, ["alibi.slopes=" + ",".join(str(s) for s in paper_slopes(4))])
    assert good.status.value == "pass", good.facts
    bad = spec_check({"rope": False, "alibi": True}, ["alibi.slopes=" + ",".join(str(s) for s in paper_slopes(8)[:4])])
    assert [d["key"] for d in bad.facts["differs"]] == ["alibi.slopes"], bad.facts


@pytest.mark.parametrize(("kv_repeat", "sdpa", "want"), [("interleave", False, "contiguous"), ("gqa", True, "contiguous"),
                                                          ("tile", True, "strided")])
def test_which_query_heads_share_a_key_head_is_read(kv_repeat, sdpa, want):
    """Query head h reads key head h // group (repeat_interleave, sdpa's enable_gqa) or h mod kv_heads (`repeat`):
    both train, only one reads a checkpoint written for the other. An --expect of the other is named."""
    if kv_repeat == "gqa" and "enable_gqa" not in torch.nn.functional.scaled_dot_product_attention.__doc__:
        pytest.skip("sdpa has no enable_gqa before torch 2.5")
    other = "strided" if want == "contiguous" else "contiguous"
    r = spec(BLOCK, kwargs={"n_kv": 2, "kv_repeat": kv_repeat, "sdpa": sdpa}, expect=[f"attn.kv_grouping={other}"],
             **{**SIZES, "n_heads": 8})
    assert (r.card.value("attn.kv_heads"), r.card.value("attn.kv_grouping")) == (2, want)
    assert [(v.key, v.status, v.measured) for v in r.verdicts] == [("attn.kv_grouping", "differs", want)]


def test_nothing_grouped_reads_no_grouping_and_a_familys_convention_judges_nothing_there():
    for kw in ({}, {"n_kv": 1}):
        e = card(BLOCK, kw)[0].get("attn.kv_grouping")
        assert not e.read and "nothing grouped" in e.skip
    convention = Claim("attn.kv_grouping", "contiguous", "--like hf:llama", tier="convention")
    assert judge(Card("blk", (e,)), (convention,)) == ()
    assert [v.status for v in judge(Card("blk", (e,)), (Claim("attn.kv_grouping", "contiguous", "--expect"),))] == ["unread"]


@HF
def test_like_a_family_claims_its_grouping_where_the_block_groups():
    """transformers groups one way (repeat_kv) in every family: hf:llama, built here without grouping, still claims
    it against a block that groups."""
    r = spec(BLOCK, kwargs={"n_kv": 2, "kv_repeat": "tile"}, like="hf:llama", **{**HF_SIZES, "n_heads": 8})
    assert r.reference.get("attn.kv_grouping").skip is not None
    assert [(v.status, v.measured) for v in r.verdicts if v.key == "attn.kv_grouping"] == [("differs", "strided")]


@pytest.mark.parametrize("style", [{"sdpa": True}, {"style": "einsum"}, {"style": "fold"}], ids=["sdpa", "einsum", "fold"])
def test_implementations_read_the_same(style):
    a, _ = card(BLOCK, {**TWIN, "softcap": None})
    b, _ = card(BLOCK, {**TWIN, "softcap": None, **style})
    for key in ("attn.scale", "attn.window", "attn.qk_norm", "rope.theta", "rope.dims", "rope.freqs", "attn.kv_heads"):
        assert a.value(key) == pytest.approx(b.value(key), rel=1e-6), key


@HF
def test_llama3_band_equals_config():
    """At 64 rotating dims three pairs fall in llama-3's band: its ends are orig / low_freq and orig / high_freq."""
    pytest.importorskip("transformers")
    c, _ = card("hf:llama", LLAMA3, d_model=128, n_heads=2)
    rp = config_of(c, "hf:llama", LLAMA3, d_model=128, n_heads=2).rope_parameters
    orig = rp["original_max_position_embeddings"]
    assert close(c.value("rope.low_freq_wavelen"), orig / rp["low_freq_factor"], 1e-4)
    assert close(c.value("rope.high_freq_wavelen"), orig / rp["high_freq_factor"], 1e-4)
    assert c.value("rope.scaling") == "llama3"


@HF
def test_gpt_oss_sinks_do_not_hide_its_window():
    """gpt-oss appends a learned sink logit to each row of scores: the keys' columns are read without it."""
    pytest.importorskip("transformers")
    c, _ = card("hf:gpt_oss")
    cfg = config_of(c, "hf:gpt_oss")
    assert c.value("attn.window") == cfg.sliding_window and close(c.value("attn.scale"), cfg.head_dim, 1e-6)
    assert close(c.value("rope.theta"), cfg.rope_parameters["rope_theta"], 1e-3)
