"""A block that runs under a reentrant checkpoint (transformers 4.x's default): torch.autograd.grad raises inside
it, so the checks that read an input gradient take it from a plain backward, and the block's parameters keep the .grad
they had."""

import torch
import zoo_training
from torch.utils.checkpoint import checkpoint
from zoo_correct import LlamaBlock

from tblock_cli.checks import Status, run_checks
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")


def test_input_gradients_go_through_a_reentrant_checkpoint_and_the_parameters_grads_stay():
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_training.py'}:ReentrantInside")
    assert type(subject.module).__name__ == zoo_training.ReentrantInside.__name__
    marker = {n: torch.full_like(p, 7.0) for n, p in subject.module.named_parameters()}
    for n, p in subject.module.named_parameters():
        p.grad = marker[n].clone()
    by = {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=("residual", "batch", "causal")).checks}
    assert {n: (c.status, c.kind) for n, c in by.items()} == {
        "residual": (Status.PASS, "residual.present"), "batch": (Status.PASS, "batch.independent"),
        "causal": (Status.PASS, "causal.respected")}, by
    assert all(torch.equal(p.grad, marker[n]) for n, p in subject.module.named_parameters())


def test_a_plain_block_still_takes_its_input_gradient_from_autograd_grad():
    """Only the reentrant refusal falls back: the plain block's parameters get no .grad from the checks."""
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_training.py'}:TrainBlock")
    by = {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=("residual", "causal")).checks}
    assert all(c.status is Status.PASS for c in by.values()), by
    assert all(p.grad is None for p in subject.module.parameters())


class ReentrantPadded(LlamaBlock):
    """A padding-masked causal block whose whole body runs under a reentrant checkpoint."""

    def forward(self, x, pad_mask=None):
        return checkpoint(super().forward, x, pad_mask, use_reentrant=True)


def test_padding_judges_a_reentrant_block_on_both_sides_its_training_backward_included():
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{__file__}:ReentrantPadded")
    (c,) = run_checks(subject, cfg, CPU, torch.float32, only=("padding",)).checks
    assert (c.status, c.kind, c.facts["sides"]) == (Status.PASS, "padding.respected", ["right", "left"]), c
    assert all(p.grad is None for p in subject.module.parameters())


def test_train_eval_sees_the_parameters_a_reentrant_checkpoint_hides_from_the_eval_graph():
    """In eval the checkpoint's graph node names its inputs, not the parameters it recomputes with (and there is no
    graph where no input requires grad): every parameter was read as unused in eval, a failure of a correct block."""
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{__file__}:ReentrantPadded")
    (c,) = run_checks(subject, cfg, CPU, torch.float32, only=("train_eval",)).checks
    assert c.status is Status.PASS, c
    assert all(p.grad is None for p in subject.module.parameters())
