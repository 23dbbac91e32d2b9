"""depth: placement detection, the per-layer numbers against a case computed by hand, exit codes."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.depth_report import detect_placement, run_depth
from tblock_cli.subject.builtin import build_block

from conftest import zoo_spec

CPU = torch.device("cpu")
runner = CliRunner()


def depth(norm="pre", layers=4, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, "seq": 6, "norm": norm, "layers": layers, "allow_mixed": True, **flags})
    return cfg, run_depth(cfg, CPU, torch.float32)


@pytest.mark.parametrize("norm, expected", [
    ("pre", ["pre"] * 4), ("post", ["post"] * 4), ("mixed", ["pre", "post", "pre", "post"]),
])
def test_placement_detected_from_outputs(norm, expected):
    _, r = depth(norm)
    assert [s.placement for s in r.layers] == expected
    mixed = [f for f in r.findings if "mixed norm placement" in f.text]
    assert bool(mixed) == (norm == "mixed")
    if mixed:
        assert mixed[0].status == "warn" and "layer(s) 1, 2, 3" in mixed[0].text


def test_placement_on_user_blocks():
    import tblock_cli

    small = dict(d_model=32, n_heads=4, seq=6, layers=3)
    pre = tblock_cli.depth("torch.nn:TransformerEncoderLayer", kwargs={"norm_first": True}, **small)
    post = tblock_cli.depth("torch.nn:TransformerEncoderLayer", **small)
    assert [s.placement for s in pre.layers] == ["pre"] * 3 and pre.final_norm
    assert [s.placement for s in post.layers] == ["post"] * 3 and not post.final_norm
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
    copies = tblock_cli.depth(layer, layers=3, seq=6)  # a module instance: copied and re-initialised per layer
    assert [s.placement for s in copies.layers] == ["pre"] * 3
    assert len({round(s.grad_param_norm, 6) for s in copies.layers}) == 3  # three different initialisations


def test_depth_layers_follow_the_preset():
    import tblock_cli

    cfg = build_config(preset="bert-large")
    assert cfg.layers == 24
    assert len(tblock_cli.depth(preset="bert-base", d_model=32, n_heads=4, d_ff=64, seq=4).layers) == 12


def test_detect_placement_thresholds():
    x = torch.randn(2, 5, 64)
    normed = torch.nn.functional.layer_norm(x, (64,))
    assert detect_placement(normed)[0] == "post"
    assert detect_placement(x + 0.5 * torch.randn_like(x))[0] == "pre"


def test_numbers_against_a_hand_computed_stack():
    """Rebuild the same 2-layer Pre-LN stack, run it by hand, and compare every per-layer number."""
    cfg, r = depth("pre", layers=2, d_model=16, n_heads=2, seq=4, batch=2)
    stack = build_block(cfg).eval()  # same seed -> same weights as inside run_depth
    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(2, 4, 16, generator=gen).requires_grad_(True)
    h0 = stack.layers[0](x)
    h0.retain_grad()
    h1 = stack.layers[1](h0)
    y = stack.final_ln(h1)
    w = torch.randn(y.shape, generator=gen)
    loss = (y * w).sum() / 8  # B * T tokens
    loss.backward()
    rms = lambda t: t.detach().pow(2).mean(-1).sqrt().mean().item()  # noqa: E731
    assert r.layers[0].act_rms == pytest.approx(rms(h0), rel=1e-6)
    assert r.layers[1].act_rms == pytest.approx(rms(h1), rel=1e-6)
    assert r.final_rms == pytest.approx(rms(y), rel=1e-6)
    assert r.layers[0].grad_input_norm == pytest.approx(x.grad.norm().item(), rel=1e-5)
    assert r.layers[1].grad_input_norm == pytest.approx(h0.grad.norm().item(), rel=1e-5)
    p1 = math.sqrt(sum(p.grad.pow(2).sum().item() for p in stack.layers[1].parameters()))
    assert r.layers[1].grad_param_norm == pytest.approx(p1, rel=1e-5)
    ratio = r.layers[0].grad_input_norm / r.layers[1].grad_input_norm
    assert f"x{ratio:.3g}" in next(f.text for f in r.findings if "gradient norm at the layer input" in f.text)


def test_final_norm_finding_and_its_absence():
    _, with_ln = depth("pre")
    assert with_ln.final_norm and with_ln.final_rms == pytest.approx(1.0, abs=0.01)
    assert any("brings the output RMS" in f.text for f in with_ln.findings)
    _, without = depth("pre", final_norm=False)
    assert not without.final_norm
    assert any(f.status == "warn" and "needs a final LayerNorm" in f.text for f in without.findings)


def test_residual_gain_per_layer():
    _, pre = depth("pre")
    _, post = depth("post")
    assert all(0.95 < s.residual_gain < 1.05 for s in pre.layers)
    assert all(0.8 < s.residual_gain < 1.0 for s in post.layers)


def test_cli_exit_codes_and_json():
    small = ["--d-model", "32", "--n-heads", "4", "--layers", "4", "--seq", "6"]
    res = runner.invoke(app, ["depth", *small, "--norm", "mixed", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [layer["placement"] for layer in data["layers"]] == ["pre", "post", "pre", "post"]
    assert {"index", "placement", "act_rms", "grad_input_norm", "grad_param_norm", "residual_gain"} <= set(data["layers"][0])
    assert data["ok"] is True and any("mixed" in f["text"] for f in data["findings"])
    res = runner.invoke(app, ["depth", *small, "--norm", "mixed", "--strict"])
    assert res.exit_code == 1 and "mixed norm placement" in res.stdout
    assert runner.invoke(app, ["depth", *small, "--strict"]).exit_code == 0
    res = runner.invoke(app, ["depth", *small, "--compare", "--json"])
    assert res.exit_code == 0 and [c["norm"] for c in json.loads(res.stdout)["compare"]] == ["pre", "post", "mixed"]
    res = runner.invoke(app, ["depth", *small, "--compare"])
    assert "mixed grad" in res.stdout
    for bad in (["--layers", "0"], ["--norm", "side"], ["--compare", "--norm", "pre"]):
        res = runner.invoke(app, ["depth", "--d-model", "32", "--n-heads", "4", *bad])
        assert res.exit_code == 2 and "Traceback" not in res.output


@pytest.mark.xdist_group("plot")  # matplotlib's import (~1.5 s) on one worker
def test_cli_depth_user_block_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "d.png"
    res = runner.invoke(app, ["depth", "--block", zoo_spec("Good"), "--d-model", "32", "--n-heads", "4", "--layers", "3",
                              "--seq", "6", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "zoo.py:Good x3" in res.stdout and png.stat().st_size > 1000
