"""finite's gradient probe: on the zero and constant-token inputs whose outputs are finite, the gradient at the input
must be too (tests/zoo_forward.py's RootAtZero divides by sqrt(mean x^2) + eps, whose derivative at a zero token is
infinite; its twin ClampedNormAtZero normalises through F.normalize, whose backward there is zero)."""

import torch

import tblock_cli
from tblock_cli.checks import Status

from conftest import TESTS


def by_name(name, **flags):
    report = tblock_cli.check(f"{TESTS / 'zoo.py'}:{name}", d_model=32, n_heads=4, threads=1, **flags)
    return {c.name: c for c in report.checks}


def test_a_gradient_not_finite_where_the_output_is_names_the_input_and_leaves_the_other_checks_running():
    by = by_name("RootAtZero")
    assert by["finite"].kind == "finite.gradient" and by["finite"].facts["inputs"] == [{"input": "zero", "got": "NaN"}]
    assert by["residual"].status == Status.PASS and by["grad_params"].status == Status.PASS  # random inputs: finite


def test_the_twin_through_f_normalize_has_finite_gradients_there():
    c = by_name("ClampedNormAtZero", only="finite")["finite"]
    assert c.kind == "finite.ok" and c.facts["gradients"] == ["constant-token", "zero"], c
    # the property the probe rests on, without the block: sqrt's derivative at 0 times 0 is NaN, F.normalize's is 0
    x = torch.zeros(1, 4, requires_grad=True)
    (x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6)).sum().backward()
    assert torch.isnan(x.grad).all()
    y = torch.zeros(1, 4, requires_grad=True)
    torch.nn.functional.normalize(y, dim=-1).sum().backward()
    assert torch.isfinite(y.grad).all()


def test_half_precision_runs_leave_the_gradients_unread():
    # in float16 a LayerNorm of eps 1e-12 (BERT's) multiplies a zero token's gradient by 1e6, past float16's range:
    # an overflow of the dtype, not a derivative's infinity; float32's run is the one that reads them
    c = by_name("RootAtZero", only="finite", dtype="float16")["finite"]
    assert c.kind == "finite.ok" and c.facts["gradients"] == [], c
