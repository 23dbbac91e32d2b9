import pytest

from tblock_cli.config import PRESETS, BlockConfig, build_config
from tblock_cli.errors import ConfigError


def test_defaults_follow_the_seed():
    cfg = build_config()
    assert (cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.norm, cfg.activation) == (512, 8, 2048, "pre", "gelu")
    assert cfg.batch != cfg.seq


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"d_model": 100, "n_heads": 8}, "not divisible"),
        ({"d_model": 0}, "--d-model must be > 0"),
        ({"seq": -1}, "--seq must be > 0"),
        ({"d_ff": 0}, "--d-ff must be > 0"),
        ({"dropout": 1.0}, "--dropout"),
        ({"dropout": -0.1}, "--dropout"),
        ({"eps": -1e-5}, "--eps"),
        ({"norm": "middle"}, "--norm"),
        ({"norm": "mixed"}, "--norm"),
        ({"activation": "swish"}, "--activation"),
        ({"dtype": "float8"}, "--dtype"),
    ],
)
def test_bad_flags_name_the_flag(flags, words):
    with pytest.raises(ConfigError, match=words):
        build_config(**flags)


def test_eps_zero_is_allowed_but_warned():
    cfg = build_config(eps=0.0)
    assert cfg.eps == 0 and any("NaN" in w for w in cfg.warnings)


def test_mixed_only_where_allowed():
    assert build_config(norm="mixed", layers=4, allow_mixed=True).norm == "mixed"


def test_explicit_flags_override_preset():
    cfg = build_config("bert-base", d_model=384, n_heads=6)
    assert (cfg.d_model, cfg.n_heads, cfg.norm, cfg.eps, cfg.layers) == (384, 6, "post", 1e-12, 12)
    with pytest.raises(ConfigError, match="unknown preset"):
        build_config("gpt5")


def test_presets_are_valid_and_use_four_times_d_ff():
    for name in PRESETS:
        cfg = build_config(name)
        assert cfg.ffn_dim == 4 * cfg.d_model, name
        assert cfg.d_model % cfg.n_heads == 0, name


def test_as_dict_resolves_d_ff():
    assert BlockConfig(d_model=64).as_dict()["d_ff"] == 256
