"""The grad_accumulation check on tests/zoo_accumulation.py: gradients that do not add up over two backwards are
caught and the parameters named; a step that is not repeatable is not judged; the block's own gradients are put
back as they were."""

import torch

import tblock_cli

from conftest import TESTS


def check(name, only=("grad_accumulation",), **flags):
    report = tblock_cli.check(f"{TESTS / 'zoo_accumulation.py'}:{name}", d_model=32, n_heads=4, threads=1, causal=True,
                              only=only, **flags)
    return {c.name: c for c in report.checks}


def test_a_backward_that_writes_grad_is_named():
    c = check("WritesGrad")["grad_accumulation"]
    assert c.kind == "grad_accumulation.lost" and c.facts["wrong"] == ["w2.weight"], c.facts
    assert abs(c.value - 0.5) < 1e-3  # .grad holds one step's gradient where two were asked: half of 2g off


def test_a_forward_that_frees_grad_loses_every_parameter():
    c = check("FreesGrad")["grad_accumulation"]
    assert c.kind == "grad_accumulation.lost" and len(c.facts["wrong"]) == c.facts["checked"] == 9, c.facts


def test_a_step_that_is_not_repeatable_is_not_judged():
    # masks from the block's own generator: no two steps alike, so accumulation cannot be compared; the same masks
    # make activation checkpointing recompute with other masks (torch saves only the global stream), which is
    # checkpointing's finding and the only one
    by = check("OwnDropoutStream", only=None)
    assert by["grad_accumulation"].kind == "grad_accumulation.not_repeatable", by["grad_accumulation"].facts
    bad = [c.name for c in by.values() if c.status.value in ("fail", "warn", "error")]
    assert bad == ["checkpointing"], bad


def test_correct_blocks_add_up_exactly_in_every_dtype():
    for dtype in ("float32", "bfloat16"):
        c = check("TrainBlock", dtype=dtype)["grad_accumulation"]
        assert c.kind == "grad_accumulation.adds" and c.facts["worst"] == 0.0, (dtype, c.facts)


def test_the_blocks_gradients_are_put_back():
    from tblock_cli.checks import run_checks
    from tblock_cli.config import build_config
    from tblock_cli.subject.loading import make_subject

    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, torch.device("cpu"), torch.float32, f"{TESTS / 'zoo_training.py'}:TrainBlock")
    marks = {n: torch.full_like(p, 7.0) for n, p in subject.module.named_parameters()}
    for n, p in subject.module.named_parameters():
        p.grad = marks[n]
    run_checks(subject, cfg, torch.device("cpu"), torch.float32, only=("grad_accumulation",))
    assert all(p.grad is marks[n] for n, p in subject.module.named_parameters())


def test_a_backward_reading_the_latest_forwards_input_is_caught_with_two_forwards_in_flight():
    """Forward, backward, forward, backward cannot tell: each backward reads the input of the forward just before.
    A second forward before the first's backward can: w2's gradient is then taken against the reversed input."""
    c = check("StashedInputLinear")["grad_accumulation"]
    assert c.kind == "grad_accumulation.interleaved" and c.facts["wrong"] == ["w2.weight"], c.facts
    ok = check("SavedInputLinear")["grad_accumulation"]
    assert ok.kind == "grad_accumulation.adds" and ok.facts["interleaved"] == 0.0, ok.facts
