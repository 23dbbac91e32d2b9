"""--block hf:TYPE: the wrapper drives a layer exactly as its model does, the battery passes, planted bugs are caught."""

import importlib.util
import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.cli import app
from tblock_cli.config import build_config

# Skipped without transformers, but not imported here: importing it costs ~2 s, and the worker that does not run
# the "hf" group below would pay it at collection for nothing.
if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed", allow_module_level=True)
from tblock_cli.subject import hf  # noqa: E402

SMALL = ["--d-model", "64", "--n-heads", "4", "--d-ff", "256"]
runner = CliRunner()
# One worker runs every test that builds a transformers model: the first model a process builds imports
# transformers' modelling machinery (~3.5 s), paid once rather than on each worker.
pytestmark = pytest.mark.xdist_group("hf")


def model_and_wrapper(model_type, **flags):
    cfg = build_config(**{"d_model": 64, "n_heads": 4, "d_ff": 256, "dropout": 0.0, **flags})
    wrapper = hf.build(model_type, cfg, {}).eval()
    return wrapper._stack, wrapper


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "llama", "qwen2"])
def test_wrapped_layer_equals_the_models_own_call(model_type):
    """Run the 1-layer model on inputs_embeds (with padding), capture what its layer got and gave back, and
    feed the same hidden states through tblock's wrapper: equal to float32 tolerance."""
    base, wrapper = model_and_wrapper(model_type)
    layer = wrapper.layers[0]
    seen = {}
    def before(_m, args, kwargs):
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def after(_m, _args, out):
        seen["out"] = out[0] if isinstance(out, tuple) else out

    h1 = layer.register_forward_pre_hook(before, with_kwargs=True)
    h2 = layer.register_forward_hook(after)
    x = torch.randn(2, 7, 64)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    try:
        with torch.no_grad():
            base(inputs_embeds=x, attention_mask=mask)
            ours = wrapper(seen["in"], attention_mask=mask)
    finally:
        h1.remove(), h2.remove()
    real = mask.bool()
    assert (ours[real] - seen["out"][real]).abs().max().item() < 1e-5


@pytest.mark.parametrize("model_type, causal", [("gpt2", True), ("bert", False), ("llama", True), ("qwen2", True)])
def test_check_passes_under_strict_with_padding_residual_and_causal_run(model_type, causal):
    args = ["check", "--block", f"hf:{model_type}", *SMALL, "--strict", "--json"] + (["--causal"] if causal else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    by = {c["name"]: c["status"] for c in json.loads(res.stdout)["checks"]}
    assert by["padding"] == by["residual"] == "pass"
    assert by["causal"] == ("pass" if causal else "skip") and by["kv_cache"] == ("pass" if causal else "skip")


def test_decoder_types_imply_causal_and_positions():
    r = tblock_cli.check("hf:llama", d_model=64, n_heads=4, d_ff=128)
    assert r.run.config["causal"] is True and r.run.config["positional"] is True
    assert r.run.config["pad_keyword"] == "attention_mask" and r.run.config["pad_means"] == "keep"
    assert tblock_cli.check("hf:bert", d_model=64, n_heads=4, d_ff=128).run.config["causal"] is False


def test_mask_polarity_inverted_is_caught():
    r = tblock_cli.check("hf:bert", d_model=64, n_heads=4, d_ff=128, pad_means="pad")  # 1 = keep read as 1 = pad
    assert {c.name: c.status for c in r.checks}["padding"] == Status.FAIL


def test_causal_mask_replaced_by_bidirectional_is_caught(monkeypatch):
    from transformers.masking_utils import create_bidirectional_mask
    from transformers.models.gpt2 import modeling_gpt2

    _, wrapper = model_and_wrapper("gpt2", causal=True)
    wrapper.config._attn_implementation = "eager"  # eager attention is causal through its mask alone
    # the model's causal mask swapped for a bidirectional one
    monkeypatch.setattr(modeling_gpt2, "create_causal_mask", lambda **kw: create_bidirectional_mask(
        config=kw["config"], inputs_embeds=kw["inputs_embeds"], attention_mask=kw["attention_mask"]))
    r = tblock_cli.check(wrapper, causal=True, pad_keyword="attention_mask", pad_means="keep")
    assert {c.name: c.status for c in r.checks}["causal"] == Status.FAIL


def test_residual_removed_by_monkeypatching_is_caught():
    _, wrapper = model_and_wrapper("llama")
    layer = wrapper.layers[0]
    real = layer.forward
    layer.forward = lambda hidden_states, **kw: real(hidden_states, **kw) - hidden_states  # no identity path left
    r = tblock_cli.check(wrapper, causal=True, positional=True, pad_keyword="attention_mask", pad_means="keep")
    assert {c.name: c.status for c in r.checks}["residual"] == Status.FAIL


def test_params_gives_the_exact_swiglu_share():
    r = tblock_cli.params("hf:llama", d_model=64, n_heads=4, d_ff=172)
    attention, ffn, norms = 4 * 64 * 64, 3 * 64 * 172, 2 * 64
    assert r.groups == {"attention": attention, "ffn": ffn, "norm": norms, "other": 0}
    assert r.ffn_share == ffn / (attention + ffn + norms)


def test_bench_need_weights_measures_output_attentions_both_ways():
    r = tblock_cli.bench("hf:bert", d_model=64, n_heads=4, d_ff=128, seq=[16], mode="infer", need_weights=True, min_time=0.01)
    off, on = r.pair("infer", 16)
    assert off.attention_kernel != on.attention_kernel and "softmax" in on.attention_kernel
    assert any("output_attentions" in f.text for f in r.findings)


def test_bench_decode_uses_the_models_cache():
    r = tblock_cli.bench("hf:llama", d_model=64, n_heads=4, d_ff=128, seq=[4], decode=6, min_time=0.01)
    cached, full = r.decode_pair()
    assert cached.cache_bytes == 2 * 1 * 2 * 10 * 64 * 4  # keys and values, 1 layer, batch 2, 10 positions, d 64


def test_unknown_type_and_missing_transformers_are_one_line_errors(monkeypatch):
    res = runner.invoke(app, ["check", "--block", "hf:no_such_model"])
    assert res.exit_code == 2 and "not a transformers model type" in res.stderr
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    r = runner.invoke(app, ["check", "--block", "hf:gpt2"])
    assert r.exit_code == 2 and "pip install 'tblock[hf]'" in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_x_transformers_encoder_loads_when_its_constructor_rejects_tblocks_names():
    pytest.importorskip("x_transformers")
    res = runner.invoke(app, ["params", "--block", "x_transformers:Encoder", "--kwargs", '{"dim": 64, "depth": 1, "heads": 4}', "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["config"]["d_model"] == 64 and data["groups"]["ffn"] == 2 * 64 * 256 + 256 + 64


def test_depth_stacks_the_models_own_layers():
    r = tblock_cli.depth("hf:gpt2", layers=3, d_model=64, n_heads=4, d_ff=128, seq=6)
    assert len(r.layers) == 3 and [s.placement for s in r.layers] == ["pre"] * 3  # GPT-2 is Pre-LN
    assert all(0.9 < s.residual_gain < 1.1 for s in r.layers)


# ----------------------------------------------------------------------------- driven as the model drives them
def statuses(report):
    return {c.name: c.status for c in report.checks}


@pytest.mark.parametrize("model_type", ["t5", "distilbert"])
def test_encoders_are_not_driven_causal_and_padded_equals_alone(model_type):
    r = tblock_cli.check(f"hf:{model_type}", d_model=32, n_heads=4, d_ff=64, threads=1)
    by = statuses(r)
    assert r.run.config["causal"] is False and by["causal"] == by["kv_cache"] == Status.SKIP
    padding = next(c for c in r.checks if c.name == "padding")
    assert padding.status == Status.PASS and padding.value < 1e-5  # padded = the same tokens alone


def test_t5_decoder_stack_is_causal_and_driven_with_its_cache():
    r = tblock_cli.check("hf:t5", d_model=32, n_heads=4, d_ff=64, threads=1, kwargs={"stack": "decoder"})
    by = statuses(r)
    assert r.run.config["causal"] is True and by["causal"] == by["kv_cache"] == Status.PASS, r.failing


def unknown_family(wrapper):
    """No family rules of its own, and its configs name a family tblock does not know (a user block holding one that
    names a known family gets that family's rules, as its hf: layer does)."""
    wrapper.by_design = {}
    for m in wrapper.modules():
        for v in list(vars(m).values()):
            if hasattr(v, "model_type") and hasattr(v, "to_dict"):
                v.model_type = "unknown"


def test_t5_unscaled_scores_pass_by_design_but_the_same_trait_warns_without_the_family():
    r = tblock_cli.check("hf:t5", d_model=64, n_heads=4, d_ff=128, threads=1)
    attention = next(c for c in r.checks if c.name == "attention")
    assert attention.status == Status.PASS and "unscaled by design of t5" in attention.detail
    _, wrapper = model_and_wrapper("t5")
    unknown_family(wrapper)  # the same layers, as a user block whose family tblock does not know
    r = tblock_cli.check(wrapper, pad_keyword="attention_mask", pad_means="keep", threads=1)
    assert statuses(r)["attention"] == Status.WARN


def test_hunyuans_qk_norms_after_rotary_pass_by_design_but_the_same_trait_warns_without_the_family():
    r = tblock_cli.check("hf:hunyuan_v1_dense", d_model=64, n_heads=4, d_ff=128, threads=1, only="relative")
    assert r.checks[0].status == Status.PASS and "after the rotary embedding" in r.checks[0].detail
    _, wrapper = model_and_wrapper("hunyuan_v1_dense")
    unknown_family(wrapper)  # the same layers, as a user block whose family tblock does not know
    r = tblock_cli.check(wrapper, threads=1, only="relative")
    assert r.checks[0].status == Status.WARN and r.checks[0].kind == "relative.gains_inside"


def test_d_ff_reaches_configs_that_name_the_ffn_width_otherwise():
    for model_type, width in (("opt", "fc1"), ("distilbert", "ffn.lin1")):
        _, wrapper = model_and_wrapper(model_type, d_ff=96)
        layer = wrapper.layers[0]
        assert layer.get_submodule(width).out_features == 96, model_type
        assert not wrapper.warnings


def test_size_dependent_fields_follow_the_head_size():
    for model_type, field, expected in (("gptj", "rotary_dim", 4), ("gemma2", "query_pre_attn_scalar", 16),
                                        ("granite", "attention_multiplier", 1 / 16)):
        _, wrapper = model_and_wrapper(model_type)
        assert getattr(wrapper.config, field) == expected, (model_type, getattr(wrapper.config, field))


@pytest.mark.parametrize("kwargs, says", [('{"num_key_value_head": 2}', "num_key_value_heads"),
                                          ('{"sliding_window": -5}', "sliding_window must be >= 0"),
                                          ('{"stack": "decoder"}', "one layer stack")])
def test_bad_kwargs_are_one_line_usage_errors(kwargs, says):
    res = runner.invoke(app, ["params", "--block", "hf:mistral", *SMALL, "--kwargs", kwargs])
    assert res.exit_code == 2 and says in res.stderr and "Traceback" not in res.stderr, res.output


def test_models_that_cannot_be_driven_say_why_in_one_line():
    res = runner.invoke(app, ["check", "--block", "hf:xlm", *SMALL])
    assert res.exit_code == 2 and "parallel lists" in res.stderr and "Traceback" not in res.stderr


def test_a_huge_layer_is_refused_before_any_weight_exists():
    """Counted on the meta device: no 17 G-parameter allocation. Judged by the process's peak memory, which load
    does not move (a wall-time bound did)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    res = runner.invoke(app, ["check", "--block", "hf:llama", "--d-model", "32768", "--n-heads", "64", "--d-ff", "131072"])
    assert res.exit_code == 2 and "MiB" in res.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1024**2  # under 1 GiB more: no weights


@pytest.mark.parametrize("model_type, attention, ffn", [
    # llama, dense: q, k, v, o of d x d; gate, up, down of d x d_ff
    ("llama", 4 * 64 * 64, 3 * 64 * 256),
    # mistral keeps its 4 q heads per kv head: 1 kv head of 16 at 4 heads
    ("mistral", 2 * 64 * 64 + 2 * 64 * 16, 3 * 64 * 256),
    # mixtral: 8 experts of 3 d x d_ff matrices and the router's d x 8; attention as mistral's
    ("mixtral", 2 * 64 * 64 + 2 * 64 * 16, 8 * 3 * 64 * 256 + 64 * 8),
    # falcon, multi-query: one fused d x (d + 2 d_head) projection and the d x d dense; a 2-matrix GELU FFN
    ("falcon", 64 * (64 + 2 * 16) + 64 * 64, 2 * 64 * 256),
    # olmo2, QK-norm over the full width: q_norm and k_norm are norms, the four projections attention
    ("olmo2", 4 * 64 * 64, 3 * 64 * 256),
    # deepseek_v3, multi-head latent attention: low-rank q and kv through their ranks (its first layers are dense)
    ("deepseek_v3", "mla", 3 * 64 * 256),
])
def test_params_groups_equal_a_hand_count_from_the_config(model_type, attention, ffn):
    r = tblock_cli.params(f"hf:{model_type}", d_model=64, n_heads=4, d_ff=256, threads=1)
    if attention == "mla":
        c = hf.build_config(model_type, build_config(d_model=64, n_heads=4, d_ff=256), {})
        d, H, q, kv, rope = 64, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
        attention = (d * q + q * H * (c.qk_nope_head_dim + rope) + d * (kv + rope) + kv * H * (c.qk_nope_head_dim + c.v_head_dim)
                     + H * c.v_head_dim * d)
    assert r.groups["attention"] == attention and r.groups["ffn"] == ffn and r.groups["other"] == 0


def test_moe_float64_reference_runs_the_eager_experts():
    r = tblock_cli.check("hf:mixtral", d_model=32, n_heads=4, d_ff=64, threads=1)
    assert statuses(r)["dtype"] == Status.PASS and r.ok


def test_layers_builds_the_model_once_and_is_not_called_builtin_only(monkeypatch):
    import transformers

    real, built = transformers.AutoModel.from_config, []

    def counted(*a, **kw):
        if torch.get_default_device().type != "meta":
            built.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModel, "from_config", counted)
    r = tblock_cli.depth("hf:llama", layers=2, d_model=32, n_heads=4, d_ff=64, seq=6, threads=1)
    assert len(r.layers) == 2 and len(built) == 1
    assert not any("built-in" in w for w in r.run.warnings)
    # the config the model implies (a rotary decoder, HF's mask) is the run's, though depth builds its layers later
    assert (r.run.config["causal"], r.run.config["positional"], r.run.config["pad_means"]) == (True, True, "keep")


def test_kv_cache_bytes_count_the_kv_heads_the_cache_holds_not_the_repeated_ones():
    r = tblock_cli.params("hf:llama", d_model=64, n_heads=4, d_ff=128, threads=1, kwargs={"num_key_value_heads": 2})
    assert r.to_dict()["kv_cache"]["bytes_per_token"] == 2 * 2 * 16 * 4  # keys and values, 2 kv heads of 16, float32


@pytest.mark.parametrize("model_type", ["doge", "bloom", "gemma3_text", "bart", "gptj", "jamba", "qwen2_moe", "nemotron", "funnel",
                                        "granite_swa", "hyperclovax", "glm_moe_dsa", "fnet", "nanochat", "flex_olmo",
                                        "mobilebert", "wavlm"])
def test_families_whose_masks_positions_or_mixers_are_their_own_are_clean_under_strict(model_type):
    """doge's mask, bloom's ALiBi, gemma3's layer types, bart's positional mask, gptj's rotary_dim, jamba's mamba
    mixer, attention_multiplier read at tblock's head size (granite_swa's muP, hyperclovax's 1/sqrt), a sparse
    attention indexer that trains on its own loss, fnet's Fourier mixing, nanochat's parameter-free per-head norms,
    flex_olmo's sublayer norms, mobilebert's linear bottleneck, wavlm's convolution module: all the model's business,
    so no check may warn."""
    r = tblock_cli.check(f"hf:{model_type}", d_model=64, n_heads=4, d_ff=128, threads=1, strict=True)
    assert r.ok and not r.run.warnings, [(c.name, c.detail) for c in r.failing] or r.run.warnings


def test_d_ff_reaches_a_user_block_that_calls_it_intermediate_dim():
    class TorchtuneStyle(torch.nn.Module):  # torchtune names the FFN width intermediate_dim
        def __init__(self, embed_dim=32, num_heads=4, intermediate_dim=999):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
            self.ffn = torch.nn.Sequential(torch.nn.Linear(embed_dim, intermediate_dim), torch.nn.GELU(),
                                           torch.nn.Linear(intermediate_dim, embed_dim))

        def forward(self, x):
            return x + self.attn(x, x, x, need_weights=False)[0] + self.ffn(x)

    r = tblock_cli.params(TorchtuneStyle, d_model=32, n_heads=4, d_ff=64)
    assert r.groups["ffn"] == 2 * 32 * 64 + 64 + 32


def test_bench_decode_expects_the_cache_a_grouped_query_model_keeps():
    """mistral at 4 heads keeps 1 key/value head: the expected cache comes from the traced widths, not from d_model."""
    report = tblock_cli.bench("hf:mistral", d_model=64, n_heads=4, d_ff=256, seq=8, decode=4, min_time=0.01, threads=1)
    cached, _ = report.decode_pair()
    assert report.decode_expected_from == "trace"
    assert report.decode_analytic_bytes == 2 * 1 * 16 * 2 * 12 * 4  # k + v x 1 layer x kv width 16 x batch x positions x fp32
    assert not [f for f in report.findings if f.kind == "bench.cache_bytes_differ"], cached.cache_bytes


def test_an_hf_block_is_built_inside_the_session_after_the_gate(monkeypatch):
    """One pipeline: threads as asked, then the memory gate, then the model: an hf: block is no longer built while the
    options are read, before --threads applies and before the command's own gate."""
    from tblock_cli import runtime
    from tblock_cli.errors import ResourceError

    seen = []
    real = hf.build
    monkeypatch.setattr(hf, "build", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    threads = 2 if torch.get_num_threads() != 2 else 3
    tblock_cli.check("hf:llama", d_model=32, n_heads=4, d_ff=64, threads=threads, only=["shape"])
    assert seen == [threads]
    seen.clear()
    monkeypatch.setattr(runtime, "free_bytes", lambda device: 2**20)  # 1 MiB free: any estimate is over
    with pytest.raises(ResourceError, match="check needs an estimated"):
        tblock_cli.check("hf:llama", d_model=32, n_heads=4, d_ff=64, threads=1)
    assert seen == []


def test_a_score_multiplier_is_read_as_the_power_of_d_head_its_default_stands_for():
    from types import SimpleNamespace as C

    from tblock_cli.subject.hf.families import _multiplier

    at = dict(num_attention_heads=8, hidden_size=512)  # default head size 64
    assert _multiplier("granite_swa", C(attention_multiplier=1.0, **at)) == 1.0  # AutoConfig's placeholder for muP
    assert _multiplier("granite_docling_text", C(attention_multiplier=1 / 64, **at)) == 1.0
    assert _multiplier("hyperclovax", C(attention_multiplier=64 ** -0.5, **at)) == 0.5
    assert _multiplier("x", C(attention_multiplier=0.3, **at)) is None and _multiplier("llama", C(**at)) is None


def test_yarn_temperature_is_read_where_mscale_all_dim_folds_into_the_softmax_scale():
    from types import SimpleNamespace as C

    from tblock_cli.subject.hf.families import MIXER, _yarn_temperature

    yarn = {"rope_type": "yarn", "factor": 128.0, "mscale_all_dim": 1.0, "mscale": 1.0}  # mistral4's default
    assert _yarn_temperature(C(rope_parameters=yarn)) == pytest.approx((0.1 * math.log(128) + 1) ** 2)
    assert _yarn_temperature(C(rope_parameters={**yarn, "mscale_all_dim": 0})) is None  # qwen2's YaRN: cos/sin only
    assert _yarn_temperature(C(rope_parameters={"rope_type": "default"})) is None and _yarn_temperature(C()) is None
    # Kimi Linear's and Bailing's delta-rule layers are mixers (kv_cache skips them: a recurrent state, no KV cache)
    assert MIXER.search("KimiLinearDeltaAttention") and MIXER.search("BailingHybridDeltaAttention")
