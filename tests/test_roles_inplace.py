"""Roles through an in-place KV cache (Meta's llama style) and a fused GLU projection split for compare.

The truths: each block's own definition in tests/zoo_meta.py (which matrix is q, k, v, out, gate, in, down), the
cache's own size per token, and Hugging Face's LlamaDecoderLayer or the unfused twin computing the same function.
"""

from types import SimpleNamespace

import pytest
import torch
import zoo_meta

import tblock_cli
from tblock_cli.anatomy import trace
from tblock_cli.comparing.mapping import fused_widths
from tblock_cli.errors import ConfigError

from conftest import TESTS

Z = f"{TESTS / 'zoo_meta.py'}:"
D, H, FF, KV = 64, 4, 256, 2
SIZES = {"d_model": D, "n_heads": H, "d_ff": FF, "seq": 8, "threads": 1}
LLAMA_B = {"num_key_value_heads": KV, "rms_norm_eps": 1e-6}
META_ROLES = {"attention.wq": "attn.q", "attention.wk": "attn.k", "attention.wv": "attn.v", "attention.wo": "attn.out",
              "feed_forward.w1": "ffn.gate", "feed_forward.w3": "ffn.in", "feed_forward.w2": "ffn.out"}
# compare builds hf:llama; on the worker of the other transformers tests, so the import is paid once
pytestmark = pytest.mark.xdist_group("hf")


def traced(block):
    torch.manual_seed(0)
    x = torch.randn(2, 10, D)
    return trace(block, block, x, D)


@pytest.mark.parametrize("cls", [zoo_meta.MetaBlock, zoo_meta.MetaBlockBuffer, zoo_meta.MetaBlockComplex])
def test_roles_of_a_meta_style_block_read_through_its_in_place_cache(cls):
    """q is q, and k and v keep their projections although attention reads them back from the cache they were
    written into (a plain attribute, a registered buffer; half-split or complex rotary)."""
    flow = traced(cls(D, H, FF, KV))
    roles = {m.name: m.role for m in flow.modules}
    assert {n: roles[n] for n in META_ROLES} == META_ROLES
    assert {m.group for m in flow.modules if m.name in ("attention_norm", "ffn_norm")} == {"norm"}
    assert not [m for m in flow.modules if m.role == "other"]
    (call,) = flow.attention
    assert (call.q, call.k, call.v) == (("attention.wq",), ("attention.wk",), ("attention.wv",))


def test_the_cached_width_is_what_the_cache_holds_per_token():
    block = zoo_meta.MetaBlock(D, H, FF, KV)
    (call,) = traced(block).attention
    per_token = block.attention.cache_k[0, 0].numel() + block.attention.cache_v[0, 0].numel()
    assert call.kv_width == per_token == 2 * KV * (D // H)  # grouped-query: half the multi-head figure here


@pytest.mark.parametrize("write", ["copy_", "index_copy_", "index_put_"])
def test_provenance_flows_through_every_way_of_writing_a_cache(write, monkeypatch):
    """gpt-fast and litgpt write their caches with index_put / index_copy_; a copy_ into a slice does the same."""
    block = zoo_meta.MetaBlockBuffer(D, H, FF, KV)
    att = block.attention
    original = att.forward

    def forward(x, start_pos, mask):  # the same attention, the cache written another way
        B, T, _ = x.shape
        xk = att.wk(x).view(B, T, att.n_kv, att.hd)
        cache = att.cache_k.detach()
        if write == "copy_":
            cache[:B, :T].copy_(xk)
        elif write == "index_copy_":
            cache[:B].index_copy_(1, torch.arange(T), xk)
        else:
            cache.index_put_((torch.arange(B)[:, None], torch.arange(T)[None]), xk)
        att.cache_k = cache
        return original(x, start_pos, mask)
    monkeypatch.setattr(att, "forward", forward)
    roles = {m.name: m.role for m in traced(block).modules}
    assert roles["attention.wk"] == "attn.k" and roles["attention.wq"] == "attn.q"


def test_a_cast_to_another_tensors_dtype_takes_nothing_of_its_values():
    """x.to(q) and x.type_as(q) lend q's dtype: a zero cache cast to q's dtype does not become q (Meta's
    `self.cache_k = self.cache_k.to(xq)` made wq read as a fused q/k/v projection)."""
    flow = traced(zoo_meta.MetaBlock(D, H, FF, KV))
    assert [m.role for m in flow.modules if m.name == "attention.wq"] == ["attn.q"]


def test_no_ffn_share_warning_on_a_meta_style_block():
    report = tblock_cli.check(Z + "MetaBlock", only="ffn_share", causal=True, positional=True, **SIZES)
    (res,) = [c for c in report.checks if c.name == "ffn_share"]
    assert res.status.value == "pass", res
    attention = 2 * D * D + 2 * D * KV * (D // H)  # wq, wo full; wk, wv grouped
    assert res.facts["matrix_ratio"] == pytest.approx(3 * D * FF / attention)


def test_a_meta_style_block_equals_hf_llama_with_its_weights_carried_by_role():
    report = tblock_cli.compare(Z + "MetaBlock", "hf:llama", **SIZES, kwargs_b=LLAMA_B)
    assert report.ok, [f.text for f in report.findings]
    assert report.mapping["counts"]["role"] == 9  # every parameter, Meta's names matching none of HF's
    roles = {p["a"]: p["role"] for p in report.mapping["pairs"]}
    assert roles["attention.wq.weight"] == "attn.q" and roles["attention.wk.weight"] == "attn.k"


def test_meta_rotary_layout_against_hf_llama_is_named():
    report = tblock_cli.compare(Z + "MetaBlockComplex", "hf:llama", **SIZES, kwargs_b=LLAMA_B)
    facts = report.first_difference.facts
    assert facts["component"] == "attn.q_pos#0"
    assert facts["rotary"] == {"a": "interleaved", "b": "half-split"}


def test_a_fused_split_that_does_not_tile_its_rows_is_refused_not_cut_short():
    flow = SimpleNamespace(attention=[SimpleNamespace(heads=4, head_dim=16)])
    assert fused_widths(64, "attn.qkv", flow) is None  # q alone is 64 rows: no room for k and v
    assert fused_widths(63, "attn.kv", flow) is None
    widths = fused_widths(128, "attn.qkv", flow)
    assert [w for _, w in widths] == [64, 32, 32] and sum(w for _, w in widths) == 128


@pytest.mark.parametrize("act", ["gelu", "relu", "tanh"])
@pytest.mark.parametrize("fused", ["FusedGLU", "FusedGLUGateFirst"])
def test_a_fused_glu_equals_its_unfused_twin_whichever_half_is_the_gate(fused, act):
    """The gate is found by measurement: ReLU (homogeneous) and tanh (odd) gates each pass one of the two scalings."""
    report = tblock_cli.compare(Z + fused, Z + "UnfusedGLU", **SIZES, kwargs_a={"act": act}, kwargs_b={"act": act})
    assert report.ok, [f.text for f in report.findings]
    pairs = {p["b"]: (p["a"], p["role"]) for p in report.mapping["pairs"]}
    value, gate = ("proj.weight[0:256]", "proj.weight[256:512]")[::1 if fused == "FusedGLU" else -1]
    assert pairs["value.weight"] == (value, "ffn.in") and pairs["gate.weight"] == (gate, "ffn.gate")


def test_a_fused_swiglu_equals_hf_llama():
    report = tblock_cli.compare(Z + "FusedSwiGLU", "hf:llama", **SIZES, kwargs_b=LLAMA_B)
    assert report.ok, [f.text for f in report.findings]
    pairs = {p["a"]: p["b"] for p in report.mapping["pairs"]}
    assert pairs["w13.weight[0:256]"].endswith("gate_proj.weight")
    assert pairs["w13.weight[256:512]"].endswith("up_proj.weight")


def test_a_bilinear_glu_split_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="both halves of its rows enter the down projection linearly"):
        tblock_cli.compare(Z + "FusedGLU", Z + "UnfusedGLU", **SIZES, kwargs_a={"act": "none"}, kwargs_b={"act": "none"})


def test_fused_halves_swapped_under_one_name_are_named():
    """Loaded by name, the two fused blocks differ: the same parameter's halves do each other's job."""
    report = tblock_cli.compare(Z + "FusedGLU", Z + "FusedGLUGateFirst", **SIZES)
    assert not report.ok
    conflicts = {(f.facts["a"], f.facts["a_role"], f.facts["b_role"]) for f in report.findings if f.kind == "mapping.name_role"}
    assert ("proj.weight", "ffn.in/ffn.gate", "ffn.gate/ffn.in") in conflicts
