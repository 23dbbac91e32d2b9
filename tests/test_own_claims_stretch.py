"""What a block says of itself about stretched rotary tables (LongRoPE's factors, a dynamic NTK's original length),
MiniCPM's depth-scaled residual, OLMo's clip_qkv and the direction a rotation turns, read into claims the card can
judge. The blocks that honour or contradict them are tests/zoo_stretch.py's, judged by test_own_claims.py."""

import math

import pytest

from tblock_cli.card.own import own_claims
from tblock_cli.card.own_fit import with_direction, with_dynamic, with_longrope
from tblock_cli.card.own_names import DYNAMIC, FAMILY, LONGROPE, YARN_GAIN
from tblock_cli.card.positions import ROPE_SEQ


def test_stretched_tables_depth_scales_clamps_and_the_direction_of_a_rotation_reading_rules():
    def claims(arguments, modules=()):
        return {c.key: c.value for c in own_claims(list(modules), arguments)}

    def fit(arguments):
        return {c.key: c.value for c in with_direction(with_dynamic(with_longrope(own_claims([], arguments))))}

    # dynamic NTK: its original length from the dict, else from max_position_embeddings beside it; theta's claim stands
    # only where that length holds the card's probe of ROPE_SEQ positions
    dyn = {"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    assert claims({**dyn, "max_position_embeddings": 2048})[DYNAMIC] == 2048
    assert fit({**dyn, "max_position_embeddings": 2048})["rope.theta"] == 1e4
    assert "rope.theta" not in fit({**dyn, "max_position_embeddings": ROPE_SEQ - 1}) and "rope.theta" not in fit(dyn)
    # LongRoPE as Phi-3 writes it: factor = max / original, attention factor sqrt(1 + ln(factor) / ln(original)); the
    # claim is the short table, theta^(-2i/dims) / short[i] slowest last, and theta itself is no longer claimed
    short, long = [1.0, 1.5, 2.0, 3.0], [1.0, 4.0, 8.0, 16.0]
    phi3 = {"rope_theta": 1e4, "max_position_embeddings": 4096, "original_max_position_embeddings": 256,
            "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long}}
    got = claims(phi3)
    assert got[LONGROPE] == (tuple(short), tuple(long), 256)
    assert got[YARN_GAIN] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(256)))
    fitted_ = fit(phi3)
    assert "rope.theta" not in fitted_
    assert fitted_["rope.freqs"] == pytest.approx([1e4 ** (-2 * i / 8) / f for i, f in enumerate(short)])
    assert "rope.freqs" not in fit({**phi3, "original_max_position_embeddings": ROPE_SEQ // 2})  # long factors at the probe
    assert claims({"rope_scaling": {"type": "su", "short_factor": short}})[LONGROPE] == (tuple(short), None, 0)
    # MiniCPM: both branches at scale_depth / sqrt(num_hidden_layers); scale_depth alone claims nothing
    depth = claims({"scale_depth": 1.4, "num_hidden_layers": 40})
    assert depth == {"residual.attn_gain": pytest.approx(1.4 / math.sqrt(40)), "residual.ffn_gain": pytest.approx(1.4 / math.sqrt(40))}
    assert claims({"scale_depth": 1.4}) == {}
    # clip_qkv claims the clamp; None (OLMo's default) nothing
    assert claims({"clip_qkv": 8}) == {"attn.clip": 8.0} and claims({"clip_qkv": None}) == {}
    # a family named beside a claim that the block rotates claims that family's direction; nothing without either
    assert fit({"rope_theta": 5e5, "model_type": "llama"})["rope.direction"] == "forward"
    assert fit({"rope_theta": 5e5, "model_type": "nanochat"})["rope.direction"] == "backward"
    assert "rope.direction" not in fit({"rope_theta": 5e5}) and "rope.direction" not in fit({"clip_qkv": 8, "model_type": "olmo"})
    assert FAMILY not in fit({"rope_theta": 5e5, "model_type": "llama"}) and claims({"model_type": "llama"}) == {}
