"""--block hf:TYPE: the wrapper drives a layer exactly as its model does, the battery passes, planted bugs are caught."""

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.cli import app
from tblock_cli.config import build_config

transformers = pytest.importorskip("transformers")
from tblock_cli import hf  # noqa: E402

SMALL = ["--d-model", "64", "--n-heads", "4", "--d-ff", "256"]
runner = CliRunner()


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
    assert any("output_attentions" in f.text for f in r.findings())


def test_bench_decode_uses_the_models_cache():
    r = tblock_cli.bench("hf:llama", d_model=64, n_heads=4, d_ff=128, seq=[4], decode=6, min_time=0.01)
    cached, full = r.decode_pair()
    assert cached.cache_bytes == 2 * 1 * 2 * 10 * 64 * 4  # keys and values, 1 layer, batch 2, 10 positions, d 64


def test_unknown_type_and_missing_transformers_are_one_line_errors():
    res = runner.invoke(app, ["check", "--block", "hf:no_such_model"])
    assert res.exit_code == 2 and "not a transformers model type" in res.stderr
    code = ("import sys; sys.modules['transformers'] = None; from tblock_cli.cli import main; "
            "sys.argv = ['tblock', 'check', '--block', 'hf:gpt2']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "pip install 'tblock[hf]'" in r.stderr and "Traceback" not in r.stderr


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
