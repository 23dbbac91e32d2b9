"""`tblock compare`: weights carried across by name and by role, equal blocks equal, planted porting bugs named."""

import json

import pytest
import torch
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.cli import app
from tblock_cli.errors import ConfigError

from conftest import TESTS

Z = f"{TESTS / 'zoo_compare.py'}:"
SIZES = {"d_model": 32, "n_heads": 4, "seq": 8, "threads": 1}
GQA = {"kwargs_a": {"n_kv_heads": 2}, "kwargs_b": {"num_key_value_heads": 2}}
# Most tests here build hf:llama, and the compile tests import dynamo (~3 s): all on the worker that runs the
# other transformers tests (tests/test_hf.py), so each import is paid once.
pytestmark = pytest.mark.xdist_group("hf")


def llama(name: str):
    return tblock_cli.compare(Z + name, "hf:llama", **SIZES, **GQA)


def first(report) -> dict:
    return report.first_difference.facts


def test_a_llama_layer_written_from_scratch_equals_hf_llama():
    report = llama("ScratchLlama")
    assert report.ok, [f.text for f in report.findings]
    assert report.mapping["counts"]["name"] == 9  # every parameter by its HF name, through the layers.0. prefix
    assert {c.name for c in report.comparisons} >= {"outputs", "padded", "input_grad", "param_grads"}
    assert all(c.rel < 1e-5 for c in report.comparisons)


def tiled_vs_interleaved(n_heads: int, n_kv: int) -> list[int]:
    """B head j reads kv head j // g (repeat_interleave); A head i reads kv head i % n_kv (repeat): pair them."""
    g = n_heads // n_kv
    perm = []
    for j in range(n_heads):
        perm.append(next(i for i in range(n_heads) if i % n_kv == j // g and i not in perm))
    return perm


def test_a_gqa_head_tiling_is_named_at_the_keys_with_its_head_permutation():
    report = llama("LlamaGQATiled")
    assert not report.ok
    facts = first(report)
    assert facts["component"] == "attn.k_pos#0"  # q/k/v projections agree; what attention reads does not
    assert facts["heads_permutation"] == tiled_vs_interleaved(4, 2) == [0, 2, 1, 3]


def test_a_gqa_head_tiling_written_out_is_named_at_the_keys_against_eager_and_sdpa():
    """Attention by hand (q.k^T, softmax, times v) on A; HF's eager and sdpa paths on B."""
    for backend in ("eager", "sdpa"):
        report = tblock_cli.compare(Z + "LlamaGQATiledEager", "hf:llama", **SIZES, kwargs_a={"n_kv_heads": 2},
                                    kwargs_b={"num_key_value_heads": 2, "attn_implementation": backend})
        facts = first(report)
        assert facts["component"] == "attn.k_pos#0" and facts["heads_permutation"] == [0, 2, 1, 3], backend


def test_a_gate_up_swap_is_named_in_the_ffn_and_the_names_that_changed_job():
    report = llama("LlamaGateUpSwapped")
    assert not report.ok
    assert first(report)["component"] == "ffn.hidden#0"
    conflicts = {(f.facts["a"], f.facts["a_role"], f.facts["b_role"]) for f in report.findings if f.kind == "mapping.name_role"}
    assert conflicts == {("mlp.gate_proj.weight", "ffn.in", "ffn.gate"), ("mlp.up_proj.weight", "ffn.gate", "ffn.in")}


def test_the_activation_after_the_gate_up_product_is_named_in_the_ffn():
    report = llama("LlamaActAfterProduct")
    assert not report.ok
    assert first(report)["component"] == "ffn.hidden#0"
    ffn = [d for d in report.components if d.component in ("ffn.gate#0", "ffn.in#0", "ffn.in#1")]
    assert ffn and all(d.rel == 0 for d in ffn)  # the projections agree: the difference is after them


def test_a_meta_rotary_layout_is_named_as_such():
    facts = first(llama("LlamaInterleavedRope"))
    assert facts["component"] == "attn.q_pos#0"
    assert facts["rotary"] == {"a": "interleaved", "b": "half-split"}


def test_transformer_encoder_layer_equals_the_builtin_block_through_the_cli():
    result = CliRunner().invoke(app, ["compare", "torch.nn:TransformerEncoderLayer", "builtin", "--dropout", "0",
                                      "--d-model", "32", "--n-heads", "4", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["command"] == "compare" and data["ok"] is True
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, json.loads((TESTS.parent / "docs" / "tblock.schema.json").read_text()))
    assert data["mapping"]["counts"]["role"] > 0  # norm1 <-> ln1, linear1 <-> ffn.fc1: by dataflow role
    follows = next(f for f in data["findings"] if f["kind"] == "compare.builtin_follows")
    assert follows["facts"]["norm"] == "post" and follows["facts"]["activation"] == "relu"  # TEL's defaults


def test_fused_qkv_equals_separate_qkv_both_ways():
    for a, b in (("FusedQKV", "SeparateQKV"), ("SeparateQKV", "FusedQKV")):
        report = tblock_cli.compare(Z + a, Z + b, **SIZES)
        assert report.ok, [f.text for f in report.findings]
        pairs = {p["b"]: p["a"] for p in report.mapping["pairs"]}
        if a == "FusedQKV":
            assert pairs["key.weight"] == "c_attn.weight[32:64]"  # the k third of the fused projection


def test_a_wrong_map_makes_them_differ(tmp_path):
    """--map overrides the matching: q and k swapped transposes the scores, which the comparison must see."""
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"query.weight": "key.weight", "key.weight": "query.weight",
                                "query.bias": "key.bias", "key.bias": "query.bias"}))
    report = tblock_cli.compare(Z + "SeparateQKV", Z + "SeparateQKV", map_file=str(path), **SIZES)
    assert not report.ok
    assert report.mapping["counts"]["map"] == 4
    assert first(report)["component"].startswith("attn.q")


def test_gpt2_conv1d_fused_weights_equal_the_builtin_block_with_its_activation():
    """GPT-2's c_attn is a transposed fused q/k/v; with exact GELU it computes the causal built-in block."""
    report = tblock_cli.compare("hf:gpt2", "builtin", **SIZES, kwargs_a={"activation_function": "gelu"})
    assert report.ok, [f.text for f in report.findings]
    assert "decode" in {c.name for c in report.comparisons}  # both have a cache, and the built-in side became causal
    # gelu_new (tanh approximation) against exact GELU: ~1e-4 apart in the gradients at d_model 64
    tanh = tblock_cli.compare("hf:gpt2", "builtin", **{**SIZES, "d_model": 64})
    assert not tanh.ok and first(tanh)["component"] == "ffn.hidden#0"


def test_a_bias_on_one_side_only_is_zeroed_and_said():
    report = tblock_cli.compare("torch.nn:TransformerEncoderLayer", "builtin", bias=False, **SIZES)
    assert report.ok, [f.text for f in report.findings]
    zeroed = {f.facts["param"] for f in report.findings if f.kind == "mapping.bias_zeroed"}
    assert {"linear1.bias", "linear2.bias", "self_attn.in_proj_bias", "norm1.bias"} <= zeroed


def test_an_unmatched_parameter_is_one_line_naming_it_and_exit_2():
    with pytest.raises(ConfigError, match="gate_proj.*ffn.gate"):
        tblock_cli.compare(Z + "ScratchLlama", "builtin", **SIZES)
    result = CliRunner().invoke(app, ["compare", Z + "ScratchLlama", "builtin", "--d-model", "32", "--n-heads", "4"])
    assert result.exit_code == 2 and "--map" in result.output


def test_bfloat16_b_gives_the_error_per_component_within_its_tolerance():
    report = tblock_cli.compare("builtin", "builtin", dtype_b="bfloat16", **SIZES)
    assert report.ok
    outputs = next(c for c in report.comparisons if c.name == "outputs")
    assert 0 < outputs.rel < 6e-2  # bf16 keeps 8 bits: ~4e-3 per rounding, a few roundings deep
    assert [d.component for d in report.components][:2] == ["norm#0", "attn.out#0"]
    assert all(0 < d.rel for d in report.components)


BREAKS = ("import torch.nn as nn\n"
          "class Breaks(nn.Module):\n"
          "    def __init__(self, d_model=16, n_heads=2):\n"
          "        super().__init__()\n"
          "        self.fc = nn.Linear(d_model, d_model)\n"
          "    def forward(self, x):\n"
          "        if x.abs().max().item() > 1e9:\n"
          "            x = x.clamp(-1e9, 1e9)\n"
          "        return x + self.fc(x)\n")


def compile_json(tmp_path, *flags) -> dict:
    block = tmp_path / "breaks.py"
    block.write_text(BREAKS)
    result = CliRunner().invoke(app, ["compare", f"{block}:Breaks", "--compile", "--d-model", "16", "--n-heads", "2",
                                      "--threads", "1", "--json", *flags])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, json.loads((TESTS.parent / "docs" / "tblock.schema.json").read_text()))
    return data


def assert_one_break_at_the_item_call(data: dict) -> None:
    assert data["ok"] and data["graph_breaks"] == 1
    reason = data["compile"]["reasons"][0]
    assert "item()" in reason["reason"] and reason["where"].endswith("breaks.py:7")
    assert data["compile"]["train_graphs"] == 2  # one graph on each side of the break, in training mode
    # the first new length marks seq dynamic (both graphs again); the second reuses them
    assert [r["new_graphs"] for r in data["compile"]["recompiles"]] == [2, 0]


def test_compile_counts_graph_breaks_with_their_reasons(tmp_path):
    """On aot_eager: dynamo's graphs and AOTAutograd's tracing without inductor's C++ builds (seconds, not a minute)."""
    data = compile_json(tmp_path, "--backend", "aot_eager")
    assert_one_break_at_the_item_call(data)
    assert data["compile"]["backend"] == "aot_eager"
    assert not any(f["kind"] == "compile.no_compiler" for f in data["findings"])  # asked for, not stepped down to


@pytest.mark.slow
def test_inductor_end_to_end_on_the_cpu(tmp_path):
    """The default backend where a C++ compiler is present: inductor builds 8 CPU kernels (35-55 s with a cold cache)."""
    from tblock_cli.comparing.compile import compiler

    if compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels")
    data = compile_json(tmp_path)
    assert data["compile"]["backend"] == "inductor"
    assert_one_break_at_the_item_call(data)


def test_the_default_backend_is_inductor_where_a_compiler_is_found(monkeypatch):
    from tblock_cli.comparing import compile as comp

    asked = []
    monkeypatch.setattr(comp, "compiler", lambda: "g++")
    monkeypatch.setattr(torch, "compile", lambda module, backend: asked.append(backend) or module)
    tiny = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
    report = tblock_cli.compare(tiny, compile=True, d_model=16, n_heads=2, seq=4, threads=1)
    assert asked == ["inductor"] and report.compile["backend"] == "inductor"
    assert report.ok and not any(f.kind == "compile.no_compiler" for f in report.findings)


def test_without_a_cxx_compiler_it_says_so_and_uses_aot_eager(monkeypatch):
    from tblock_cli.comparing import compile as comp

    monkeypatch.setattr(comp, "compiler", lambda: None)
    tiny = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
    report = tblock_cli.compare(tiny, compile=True, d_model=16, n_heads=2, seq=4, threads=1)
    assert report.ok and report.compile["backend"] == "aot_eager"
    assert any(f.kind == "compile.no_compiler" for f in report.findings)
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):  # asked for by name: refused, not stepped down
        tblock_cli.compare(tiny, compile=True, backend="inductor", d_model=16, n_heads=2, seq=4, threads=1)


def test_bad_input_is_a_config_error():
    with pytest.raises(ConfigError, match="two blocks"):
        tblock_cli.compare("builtin")
    with pytest.raises(ConfigError, match="drop B"):
        tblock_cli.compare("builtin", "builtin", compile=True)
    with pytest.raises(ConfigError, match="needs --compile"):
        tblock_cli.compare("builtin", "builtin", backend="eager")
    with pytest.raises(ConfigError, match="must be one of inductor, aot_eager, eager"):
        tblock_cli.compare("builtin", compile=True, backend="tvm")


def test_compare_leaves_torch_unimported_until_called():
    import subprocess
    import sys

    code = "import tblock_cli, sys; tblock_cli.compare; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_modules_handed_in_are_left_as_they_were():
    """A's weights are written into B's copy, not into the caller's B."""
    import torch.nn as nn

    a = nn.TransformerEncoderLayer(32, 4, 128, 0.0, batch_first=True)
    b = nn.TransformerEncoderLayer(32, 4, 128, 0.0, batch_first=True)
    before = b.linear1.weight.detach().clone()
    assert not torch.equal(a.linear1.weight, before)
    assert tblock_cli.compare(a, b, threads=1).ok  # equal only because A's weights reached B's copy
    assert torch.equal(b.linear1.weight, before)


def test_compare_is_gated_before_any_weight_exists():
    """Two 17-billion-parameter hf:llama layers: refused by the memory gate (exit 2) in seconds, before transformers
    is even imported (the gate reads the config's sizes); free memory pinned at 64 GiB so any machine answers alike."""
    import subprocess
    import sys
    import time

    code = ("import sys\nimport tblock_cli.runtime as r\nr.free_bytes = lambda device: 64 * 2**30\n"
            "from tblock_cli.cli import main\ntry:\n"
            "    main(['compare', 'hf:llama', 'hf:llama', '--d-model', '32768', '--n-heads', '64', '--d-ff', '131072'])\n"
            "except SystemExit as e:\n    print(e.code, 'transformers' in sys.modules)\n")
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert "compare needs an estimated" in r.stderr and "65,536 MiB free" in r.stderr
    assert time.perf_counter() - started < 30
