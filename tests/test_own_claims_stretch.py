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


def test_deepseeks_yarn_gain_on_the_softmax_scale_reading_rules():
    from tblock_cli.card.own_fit import with_softmax_gain
    from tblock_cli.card.own_names import SOFTMAX_GAIN

    def claims(d):
        return {c.key: c.value for c in own_claims([], {"rope_scaling": d})}

    v3 = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    gain = (0.1 * math.log(40) + 1) ** 2  # transformers' yarn_apply_mscale: the scale times mscale(40, 1)^2
    assert claims(v3)[SOFTMAX_GAIN] == pytest.approx(gain) and YARN_GAIN not in claims(v3)
    # the table's own gain is the ratio mscale(f, mscale) / mscale(f, mscale_all_dim): only where it is 1 is there one
    # score scale (V2-Lite's 0.707 and 0.707 too); a lone mscale_all_dim leaves the table scaled: nothing claimed
    assert SOFTMAX_GAIN in claims({**v3, "mscale": 0.707, "mscale_all_dim": 0.707})
    assert SOFTMAX_GAIN not in claims({**v3, "mscale": 0.5}) and SOFTMAX_GAIN not in claims({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0})
    assert SOFTMAX_GAIN in claims({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0, "attention_factor": 1.0})
    # X = head_dim / gain^2 over the q.k width the card reads; a module's own `scaling` attribute gives way to it
    from tblock_cli.card.entries import Claim
    # only for a family whose transformers code applies it: Ministral 3 keeps mscale_all_dim and scales its table alone
    kept = Claim("attn.scale", 24.0, "the block's own Attention.scaling", tier="kept")
    said = (kept, Claim(SOFTMAX_GAIN, gain, "config"), Claim(FAMILY, "deepseek_v3", "config"))
    fitted_ = [(c.key, c.value) for c in with_softmax_gain(said, 24) if c.key != FAMILY]
    assert fitted_ == [("attn.scale", pytest.approx(24 / gain ** 2))]
    ministral = (kept, Claim(SOFTMAX_GAIN, gain, "config"), Claim(FAMILY, "ministral3", "config"))
    assert [(c.key, c.value) for c in with_softmax_gain(ministral, 24) if c.key != FAMILY] == [("attn.scale", 24.0)]
    assert SOFTMAX_GAIN not in {c.key for c in with_softmax_gain(said[1:2], 24)}  # no family: nothing claimed


def test_transformers_deepseek_v3_attention_under_yarn_matches_its_claim_and_a_port_without_the_gain_differs():
    pytest.importorskip("transformers")
    import torch
    import torch.nn as nn
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from tblock_cli.card.attention import SCALE_SEQ
    from tblock_cli.card.entries import judge
    from tblock_cli.card.own_fit import fitted, needed
    from tblock_cli.card.read import read_card
    from tblock_cli.checks.training import all_modules
    from tblock_cli.config import build_config
    from tblock_cli.subject.loading import user_subject

    def layer(keep_plain_scale):
        config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                  rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0})
        config._attn_implementation = "eager"

        class MLALayer(nn.Module):
            def __init__(self):
                super().__init__()
                self.config, self.norm = config, nn.RMSNorm(64, eps=1e-6)
                self.attn, self.rope = DeepseekV3Attention(config, layer_idx=0), DeepseekV3RotaryEmbedding(config)
                if keep_plain_scale:  # a port that keeps qk_head_dim^-0.5
                    self.attn.scaling = self.attn.qk_head_dim ** -0.5
                with torch.no_grad():
                    for p in self.attn.parameters():
                        if p.dim() > 1:
                            p.normal_(0, p.shape[-1] ** -0.5)

            def forward(self, x):
                T = x.shape[1]
                cos, sin = self.rope(x, torch.arange(T)[None])
                mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
                return x + self.attn(self.norm(x), (cos, sin), attention_mask=mask)[0]

        return MLALayer()

    cfg = build_config(d_model=64, n_heads=4, threads=1)
    verdicts = {}
    for plain in (False, True):
        subject = user_subject(layer(plain), "mla", cfg, torch.device("cpu"), torch.float32)
        claims = own_claims(all_modules(subject.module))
        card = read_card(subject, cfg, torch.device("cpu"), keys=needed(claims))
        (verdicts[plain],) = [v for v in judge(card, fitted(claims, card, SCALE_SEQ, 64)) if v.key == "attn.scale"]
    assert verdicts[False].status == "match" and verdicts[False].measured == pytest.approx(24 / (0.1 * math.log(40) + 1) ** 4, rel=1e-3)
    assert verdicts[True].status == "differs" and verdicts[True].measured == pytest.approx(24.0, rel=1e-3)


def test_gpt2s_score_scale_switches_read_at_the_layers_index_against_transformers_gpt2_block():
    """GPT-2's `scale_attn_weights` False claims q.k undivided (X = 1), and `scale_attn_by_inverse_layer_idx` divides
    by the layer's index + 1 as well: X = d_head (idx + 1)^2, or (idx + 1)^2 unscaled. transformers' GPT2Block at
    layer 2 matches; a port that keeps 1/sqrt(d_head) alone differs (16, not 144 or 9)."""
    assert {c.key: c.value for c in own_claims([], {"scale_attn_weights": False})} == {"attn.scale": 1.0}
    assert own_claims([], {"scale_attn_weights": True}) == ()
    assert own_claims([], {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True}) == ()  # no index
    pytest.importorskip("transformers")
    import torch
    import torch.nn as nn
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tblock_cli.checks import Status, run_checks
    from tblock_cli.config import build_config
    from tblock_cli.subject.loading import user_subject

    def layer(scaled: bool, port: bool) -> nn.Module:
        config = GPT2Config(n_embd=64, n_head=4, scale_attn_by_inverse_layer_idx=True, scale_attn_weights=scaled,
                            attn_pdrop=0.0, resid_pdrop=0.0)
        config._attn_implementation = "eager"

        class Layer(nn.Module):
            def __init__(self):
                super().__init__()
                self.config, self.block = config, GPT2Block(config, layer_idx=2)
                if port:  # a port that keeps 1/sqrt(d_head) alone
                    self.block.attn.scaling = 16 ** -0.5

            def forward(self, x):
                out = self.block(x)
                return out[0] if isinstance(out, tuple) else out

        return Layer()

    cfg = build_config(d_model=64, n_heads=4, threads=1, causal=True)
    cpu = torch.device("cpu")
    for scaled, claimed in ((True, 144.0), (False, 9.0)):
        got = {}
        for port in (False, True):
            subject = user_subject(layer(scaled, port), "gpt2", cfg, cpu, torch.float32)
            got[port] = {c.name: c for c in run_checks(subject, cfg, cpu, torch.float32, only=("spec", "attention")).checks}
        assert got[False]["spec"].kind == "spec.matches" and got[False]["attention"].status is Status.PASS
        (differs,) = got[True]["spec"].facts["differs"]
        assert differs["key"] == "attn.scale" and differs["claimed"] == claimed
        assert differs["measured"] == pytest.approx(16.0, rel=1e-3)
