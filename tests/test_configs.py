"""Blocks whose constructor takes a config object: the object built from the flags under its own field names."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject
from tblock_cli.subject.setup import setup

from conftest import TESTS

CPU = torch.device("cpu")
SPEC = f"{TESTS / 'blocks_configs.py'}"


def load(name, kwargs=None, **flags):
    cfg = build_config(**{"d_model": 64, "n_heads": 4, "dropout": 0.0, **flags})
    return make_subject(cfg, CPU, torch.float32, f"{SPEC}:{name}", kwargs).module


def test_nanogpt_style_dataclass_unannotated():
    # GPTConfig's block_size and vocab_size have no default: placeholders; n_embd and n_head come from the flags
    block = load("Block", dropout=0.25)
    assert block.ln_1.normalized_shape == (64,) and block.attn.n_head == 4
    assert block.attn.c_attn.weight.shape == (3 * 64, 64) and block.mlp.dropout.p == 0.25


def test_gpt_fast_style_dataclass_with_grouped_heads():
    block = load("TransformerBlock", '{"n_local_heads": 2}', d_ff=96)
    head_dim = 64 // 4
    assert block.wqkv.weight.shape == ((4 + 2 * 2) * head_dim, 64)  # q of 4 heads, k and v of 2
    assert block.w1.weight.shape == (96, 64) and block.n_local_heads == 2


def test_from_name_preset_then_the_flags():
    # the preset: 4 query heads sharing 2 kv heads (pairs), intermediate_size 128; the flags set the widths they name
    block = load("TransformerBlock", '{"name": "tiny"}', d_model=32, n_heads=2, d_ff=48)
    assert block.head_dim == 16 and block.w1.weight.shape == (48, 32)
    assert block.n_local_heads == 1  # the preset's grouping (2 query heads per kv head) kept at 2 heads
    block = load("TransformerBlock", '{"name": "tiny"}', d_model=128, n_heads=8)
    assert block.n_local_heads == 4 and block.wqkv.weight.shape == ((8 + 2 * 4) * 16, 128)
    block = load("TransformerBlock", '{"name": "tiny", "n_local_heads": 8}', d_model=128, n_heads=8)
    assert block.n_local_heads == 8  # --kwargs stands as written


def test_attribute_bag_gets_the_fields_its_code_reads():
    block = load("BagBlock", dropout=0.125)
    assert block.attn.embed_dim == 64 and block.attn.num_heads == 4
    assert block.attn.dropout == 0.125 and block.drop.p == 0.125
    assert block.bias.shape[0] >= 16  # block_size: a placeholder long enough for the probe


def test_a_size_flag_no_field_takes_is_warned():
    s = setup(f"{SPEC}:Block", {"d_model": 64, "n_heads": 4, "d_ff": 128})
    s.build()
    assert any(w.startswith("--d-ff does not reach") and "GPTConfig" in w for w in s.warnings)
    s = setup(f"{SPEC}:Block", {"d_model": 64, "n_heads": 4})  # not given: nothing to warn about
    s.build()
    assert not any("does not reach" in w for w in s.warnings)


def test_params_from_the_cli_with_no_adapter():
    result = CliRunner().invoke(app, ["params", "--block", f"{SPEC}:Block", "--d-model", "64", "--n-heads", "4",
                                      "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    d = 64  # nanoGPT's block with biases: two LayerNorms, c_attn (d -> 3d), c_proj, c_fc (d -> 4d), c_proj (4d -> d)
    assert json.loads(result.output)["total"] == 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)


def kv_bytes_per_token(spec, kwargs):
    args = ["params", "--block", spec, "--d-model", "64", "--n-heads", "4", "--threads", "1", "--causal", "--json"]
    result = CliRunner().invoke(app, args + (["--kwargs", kwargs] if kwargs else []))
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["kv_cache"]["bytes_per_token"]


@pytest.mark.parametrize("name, kwargs, per_token", [
    ("TransformerBlock", '{"n_local_heads": 2}', lambda b: (b.k_cache.numel() + b.v_cache.numel()) // b.k_cache.shape[2]),
    ("TransformerBlock", None, lambda b: (b.k_cache.numel() + b.v_cache.numel()) // b.k_cache.shape[2]),
    ("LlamaLayer", '{"n_kv_heads": 1}', lambda b: (b.cache_k.numel() + b.cache_v.numel()) // b.cache_k.shape[:2].numel()),
    ("LlamaLayer", '{"n_kv_heads": 2}', lambda b: (b.cache_k.numel() + b.cache_v.numel()) // b.cache_k.shape[:2].numel()),
])
def test_kv_bytes_of_grouped_query_heads_are_what_the_cache_holds(name, kwargs, per_token):
    # the block's own cache, per (batch row, position), in float32: grouped heads repeated for the product count once
    block = load(name, kwargs)
    assert kv_bytes_per_token(f"{SPEC}:{name}", kwargs) == per_token(block) * 4


def test_meta_style_layer_index_and_cuda_cache():
    block = load("LlamaLayer", '{"n_kv_heads": 2}')
    assert block.layer_id == 0  # the required layer index: the first layer's
    assert block.cache_k.device == CPU or torch.cuda.is_available()  # placed with .cuda(), built on the CPU
    assert block.wk.weight.shape == (2 * 16, 64) and block.wq.weight.shape == (64, 64)
