"""Parameter and FLOP counts against formulas derived here and against torch's own counts."""

import io
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import tblock_cli
from tblock_cli import render
from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.params_report import param_report
from tblock_cli.subject.loading import make_subject

from conftest import zoo_spec

CPU = torch.device("cpu")


def report_for(dtype=torch.float32, spec=None, depth=None, **flags):
    cfg = build_config(**flags)
    subject = make_subject(cfg, CPU, dtype, spec)
    return cfg, subject, param_report(subject, cfg, dtype, depth)


def counted_flops(subject, x):
    """FlopCounterMode over one forward and one forward + backward, where it sees every matmul: grad on,
    the MHA fast path off, math attention (an independent count for the analytic one)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    subject.module.eval()
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
            with FlopCounterMode(display=False) as fwd:
                subject(x)
            with FlopCounterMode(display=False) as step:
                out = subject(x.detach().clone().requires_grad_(True))
                out.backward(torch.ones_like(out))
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return None, int(fwd.get_total_flops()), int(step.get_total_flops())


def expected_layer_params(d, f, bias):
    """Derived by hand: LN 2d (d without bias) each; q, k, v, out d^2 (+d); fc1 d f (+f); fc2 f d (+d)."""
    ln = 2 * d if bias else d
    return 2 * ln + 4 * (d * d + (d if bias else 0)) + (d * f + (f if bias else 0)) + (f * d + (d if bias else 0))


@pytest.mark.parametrize("d, h, f, bias, layers, norm", [
    (64, 4, None, True, 1, "pre"), (64, 4, 96, False, 1, "pre"), (48, 6, 200, True, 3, "pre"),
    (32, 2, None, False, 2, "post"), (128, 8, 512, True, 4, "post"),
])
def test_counts_against_formula_and_torch(d, h, f, bias, layers, norm):
    cfg, subject, r = report_for(d_model=d, n_heads=h, d_ff=f, bias=bias, layers=layers, norm=norm)
    ff = f or 4 * d
    final = (2 * d if bias else d) if layers > 1 and norm == "pre" else 0
    assert r.total == expected_layer_params(d, ff, bias) * layers + final
    assert r.total == sum(p.numel() for p in subject.module.parameters())
    per_layer = [c for c in r.components if c.name != "final_ln"]
    assert sum(c.params for c in per_layer) * layers + final == r.total
    assert sum(r.groups.values()) == r.total
    by = {c.name: c for c in r.components}
    assert by["attn.q"].params == d * d + (d if bias else 0)
    assert by["ffn.fc1"].params == d * ff + (ff if bias else 0)
    assert by["attn.scores"].params == 0 and by["attn.scores"].flops_per_token == 2 * cfg.seq * d
    assert all(c.bytes == 4 * c.params for c in r.components)
    assert ("final_ln" in by) == bool(final)


def test_bytes_follow_dtype():
    _, _, r = report_for(dtype=torch.bfloat16, d_model=32, n_heads=4)
    assert r.total_bytes == 2 * r.total


def test_ffn_share_is_two_thirds_at_four_d():
    for d in (64, 256, 1024):
        _, _, r = report_for(d_model=d, n_heads=4, bias=False)
        # no biases: norms are the only difference from 8d^2 / 12d^2
        assert r.ffn_share == pytest.approx(8 * d * d / (12 * d * d + 2 * d))  # two weight-only norms
        assert abs(r.ffn_share - 2 / 3) < 0.01
    _, _, r = report_for(d_model=64, n_heads=4, d_ff=128)
    assert "not 4" in r.ffn_note and r.ffn_share < 0.55


@pytest.mark.parametrize("flags", [
    dict(d_model=64, n_heads=4, seq=16), dict(d_model=48, n_heads=6, d_ff=100, seq=9, batch=3, layers=2),
    dict(d_model=32, n_heads=4, bias=False, causal=True, norm="post", seq=12),
])
def test_analytic_flops_match_flop_counter(flags):
    """Where FlopCounterMode sees every matmul (grad on, fast path off, math attention) it agrees exactly."""
    cfg, subject, r = report_for(**flags)
    d, f, N, L = cfg.d_model, cfg.ffn_dim, cfg.batch * cfg.seq, cfg.seq
    by_hand = cfg.layers * (N * 8 * d * d + 4 * N * L * d + 4 * N * d * f)
    assert r.flops["forward"] == by_hand
    assert r.flops["forward_seq_quadratic"] == cfg.layers * 4 * N * L * d
    x = torch.randn(cfg.batch, cfg.seq, d)
    _, fwd, step = counted_flops(subject, x)
    assert (fwd, step) == (r.flops["forward"], r.flops["train_step"])


def test_flop_counter_is_blind_to_the_eval_fast_path():
    """Why tblock counts analytically: in eval + no_grad, MHA's fused kernel counts as 0 FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        mha(x, x, x, need_weights=False)
    assert fc.get_total_flops() == 0


def test_user_block_rows_and_flops():
    cfg, subject, r = report_for(spec=zoo_spec("LlamaBlock"), d_model=64, n_heads=4, causal=True)
    names = [c.name for c in r.components]
    assert names[:2] == ["attn_norm", "q_proj"] and "down" in names
    assert r.total == sum(p.numel() for p in subject.module.parameters())
    hidden = int(8 * 64 / 3)
    assert r.groups["ffn"] == 3 * 64 * hidden and r.groups["attention"] == 4 * 64 * 64 and r.groups["norm"] == 128
    assert r.flops_source == "dataflow trace"
    N, L, d = cfg.batch * cfg.seq, cfg.seq, 64
    assert r.flops["forward"] == N * 2 * (4 * d * d + 3 * d * hidden) + 4 * N * L * d
    roles = {c.name: c.role for c in r.components}
    assert roles["q_proj"] == "attn.q" and roles["gate"] == "ffn.gate" and roles["up"] == "ffn.in" and roles["down"] == "ffn.out"
    assert {c.name: c.out_shape for c in r.components}["gate"] == (cfg.batch, cfg.seq, hidden)


def test_user_block_tree_depth_and_shared_parameters_counted_once():
    _, subject, r = report_for(spec=zoo_spec("TorchPreLN"), d_model=32, n_heads=4, depth=2)
    by = {c.name: c for c in r.components}
    assert "self_attn.out_proj" in by and "self_attn (own)" in by and "linear1" in by
    assert by["self_attn (own)"].params == 3 * 32 * 32 + 3 * 32  # in_proj weight and bias
    assert all(c.params >= 0 and c.flops_per_token >= 0 for c in r.components)
    assert sum(c.params for c in r.components) == r.total
    _, _, roles = report_for(spec=zoo_spec("TorchPreLN"), d_model=32, n_heads=4)
    assert sum(c.flops_per_token for c in r.components) == sum(c.flops_per_token for c in roles.components)


def test_tied_weights_counted_once():
    class Tied(torch.nn.Module):
        def __init__(self, d_model=32):
            super().__init__()
            self.a = torch.nn.Linear(d_model, d_model)
            self.b = torch.nn.Linear(d_model, d_model)
            self.b.weight = self.a.weight

        def forward(self, x):
            return x + self.b(self.a(x))

    import sys
    import types

    mod = types.ModuleType("tied_mod")
    mod.Tied = Tied
    sys.modules["tied_mod"] = mod
    _, _, r = report_for(spec="tied_mod:Tied", d_model=32, n_heads=4)
    assert r.total == 32 * 32 + 2 * 32
    assert sum(c.params for c in r.components) == r.total


def test_render_at_fixed_width():
    _, _, r = report_for(d_model=64, n_heads=4, layers=2)
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(render.params_view(r))
    text = console.file.getvalue()
    for word in ("attn.q", "ffn.fc1", "final_ln", "one layer", "total", f"{r.total:,}", "2/3 rule", "seq^2"):
        assert word in text, word
    assert max(len(line) for line in text.splitlines()) <= 100


def test_cli_json_and_presets():
    runner = CliRunner()
    res = runner.invoke(app, ["params", "--preset", "gpt2-small", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["total"] == 85_056_000  # GPT-2 small without embeddings: 12 x 7,087,872 + ln_f 1,536
    assert {"name", "group", "role", "params", "bytes", "flops_per_token", "grows_with_seq", "out_shape"} == set(data["components"][0])
    assert data["schema_version"] == 1 and data["command"] == "params" and data["kv_cache"]["bytes_per_token"] == 2 * 12 * 768 * 4
    assert set(data["flops"]) >= {"forward", "train_step"}
    assert 0.66 < data["ffn_share"] < 0.67
    res = runner.invoke(app, ["params", "--preset", "bert-base", "--json"])
    assert json.loads(res.stdout)["total"] == 12 * 7_087_872  # BERT-base encoder layers
    res = runner.invoke(app, ["params", "--list-presets"])
    assert res.exit_code == 0 and "gpt2-medium" in res.stdout and "bert-large" in res.stdout
    res = runner.invoke(app, ["params", "--preset", "nope"])
    assert res.exit_code == 2 and "unknown preset" in res.stderr


def test_large_presets_are_counted_without_allocating():
    """gpt2-xl: 48 x (12 d^2 + 13 d) + 2 d with d = 1600, counted on the meta device."""
    res = CliRunner().invoke(app, ["params", "--preset", "gpt2-xl", "--json"])
    assert res.exit_code == 0, res.output
    d = 1600
    assert json.loads(res.stdout)["total"] == 48 * (12 * d * d + 13 * d) + 2 * d == 1_475_561_600


def test_user_block_without_ffn_omits_the_share():
    _, _, r = report_for(spec=zoo_spec("AttentionOnly"), d_model=32, n_heads=4)
    assert r.ffn_share is None and "FFN share omitted" in r.ffn_note
    assert r.groups["attention"] == 4 * 32 * 32 + 4 * 32 and r.groups["norm"] == 64
    res = CliRunner().invoke(app, ["params", "--block", zoo_spec("AttentionOnly"), "--d-model", "32", "--n-heads", "4", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ffn_share"] is None


@pytest.mark.parametrize("layers", [1, 2])
def test_tree_depth_on_the_builtin_block_counts_every_parameter_once(layers):
    """params --tree-depth traces a forward: the built-in block is built with values for it (not on the meta device)."""
    from tblock_cli.config import build_config
    from tblock_cli.subject.builtin import build_block

    report = tblock_cli.params(d_model=32, n_heads=4, layers=layers, tree_depth=1, threads=1)
    module = build_block(build_config(d_model=32, n_heads=4, layers=layers))
    assert report.total == sum(p.numel() for p in module.parameters())
    assert sum(c.params for c in report.components) == report.total
    assert {c.name.split(" ")[0] for c in report.components} >= ({"layers"} if layers > 1 else {"ln1", "attn", "ffn"})
