"""The dropout check: masks of the block's own judged by their mean (tests/zoo_dropout.py's plants caught by the kind
meant for each, its twins clean in the whole battery), and where a dropout sits, the rate it runs at and whose mask
it is; the mode that turns torch's dropouts off against torch's own calls."""

import pytest
import torch
import torch.nn as nn
import zoo_dropout

from tblock_cli.checks import Status, dropout, run_checks
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(name, only=("dropout",), spec_file="zoo_dropout.py", **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / spec_file}:{name}" if name else None)
    return {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=only).checks}


@pytest.mark.parametrize("name", sorted(zoo_dropout.PLANTED))
def test_a_dropout_of_the_blocks_own_that_changes_the_mean_is_caught(name):
    c = run(name, only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert c.status is Status.FAIL and c.kind == zoo_dropout.PLANTED[name], c


@pytest.mark.parametrize("name", zoo_dropout.CORRECT)
def test_dropout_twins_raise_no_alarm_in_the_whole_battery(name):
    by = run(name, only=None, spec_file="zoo_dropout.py")
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_dropout_names_the_module_and_tells_torch_only_and_noise_apart():
    # the built-in block's dropouts are all torch's: off, training is eval; gating noise stays at dropout 0: not judged;
    # a hand-made mask in a submodule is judged there, 0.33 of the spread off at p = 0.1 (sqrt(p / (1 - p)))
    assert run(None, only=("dropout",))["dropout"].kind == "dropout.torch_only"
    assert run("NoisyGating", only=("dropout",), spec_file="zoo_dropout.py")["dropout"].kind == "dropout.other_noise"
    c = run("UnscaledDropout", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert c.facts["shrinks"] and c.value == pytest.approx((0.1 / 0.9) ** 0.5, abs=0.05), c.facts
    grows = run("DoubleScaledDropout", only=("dropout",), spec_file="zoo_dropout.py", dropout=0.2)["dropout"]
    assert grows.kind == "dropout.rescaled", grows


def test_torch_dropout_off_is_the_mean_of_torchs_masks():
    # F.dropout, SDPA's dropout_p and nn.MultiheadAttention's dropout, off: a training call equals the eval call
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g)
    mha = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    q = x.view(2, 5, 4, 4).transpose(1, 2)
    with torch.no_grad():
        want = (mha.eval()(x, x, x, need_weights=False)[0], nn.functional.scaled_dot_product_attention(q, q, q))
        with dropout.TorchDropoutOff():
            assert torch.equal(nn.functional.dropout(x, 0.5, True), x)
            got = (mha.train()(x, x, x, need_weights=False)[0],
                   nn.functional.scaled_dot_product_attention(q, q, q, None, 0.5))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_block_that_cannot_run_with_torchs_dropouts_off_is_skipped_not_an_error(monkeypatch):
    def refuse(self, func, types, args=(), kwargs=None):
        raise RuntimeError("no function modes here")
    monkeypatch.setattr(dropout.TorchDropoutOff, "__torch_function__", refuse)
    c = run("UnscaledDropout", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert c.status is Status.SKIP and c.kind == "dropout.unsupported" and "function modes" in c.facts["error"], c


def test_torch_dropout_off_records_the_rates_asked_and_drop_all_zeroes_only_training_calls():
    # the rates are the arguments, in call order; eval calls (training=False) and rate 0 are not dropouts
    x = torch.randn(2, 5, 16)
    q = x.view(2, 5, 4, 4).transpose(1, 2)
    mode = dropout.TorchDropoutOff(drop_all=True)
    with torch.no_grad(), mode:
        assert torch.equal(nn.functional.dropout(x, 0.3, True), torch.zeros_like(x))
        assert torch.equal(nn.functional.dropout(x, 0.3, False), x)
        assert torch.equal(nn.functional.dropout(x, 0.0, True), x)
        nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.2)
    assert mode.rates == [0.3] and mode.attention_rates == [0.2] and mode.calls == [0.3, 0.2]


def test_the_stream_gain_is_the_identity_for_a_branch_dropout_and_zero_for_a_stream_one():
    # every dropout dropping all: a branch dropout leaves x + (the undropped attention) in a Pre-LN block, gain ~1;
    # a dropout after the add leaves nothing of x: exactly 0
    stream = run("StreamDropout", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert stream.facts["gain"] == pytest.approx(0.0, abs=1e-6) and stream.facts["eval_gain"] > 0.5, stream.facts
    assert run("BranchInputDropout", only=("dropout",), spec_file="zoo_dropout.py")["dropout"].status is Status.PASS


def test_a_rate_read_as_a_keep_probability_names_both_rates_and_a_fixed_rate_is_not_judged():
    c = run("KeepProbDropout", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert c.facts["asked"] == pytest.approx(0.1) and c.facts["ran"] == [pytest.approx(0.9)], c.facts
    assert c.facts["other_ran"] == [pytest.approx(1 - c.facts["other"])], c.facts
    assert run("FixedAttentionRate", only=("dropout",), spec_file="zoo_dropout.py")["dropout"].status is Status.PASS


def test_a_decision_for_the_whole_batch_is_not_a_shared_mask():
    # batch-mode stochastic depth keeps both branches at seeds 1 and 2 (training then differs from eval by the 1/(1-p)
    # scale): at dropout 0.5 its draws show, so it is not called a rescale; nor, drawn, a mask shared by the batch
    c = run("BatchModeDepth", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert c.kind == "dropout.rare_draws", c
    shared = run("BatchSharedMask", only=("dropout",), spec_file="zoo_dropout.py")["dropout"]
    assert shared.kind == "dropout.shared" and shared.facts["forwards"] == dropout.SHARED_RUNS, shared


class RefusesEverythingDropped(nn.Module):
    """A residual block whose forward raises where its dropout returned nothing but zeros (a guard of its own)."""

    def __init__(self, d_model=32, n_heads=4, dropout=0.1):
        super().__init__()
        self.lin, self.drop = nn.Linear(d_model, d_model), nn.Dropout(dropout)

    def forward(self, x):
        y = self.drop(self.lin(x))
        if self.training and not bool(y.any()):
            raise RuntimeError("nothing kept")
        return x + y


def test_a_block_that_raises_with_everything_dropped_is_not_judged_there():
    import tblock_cli

    c = tblock_cli.check(RefusesEverythingDropped(), d_model=32, n_heads=4, only="dropout").checks[0]
    assert c.status is Status.PASS and c.kind == "dropout.torch_only", c


def test_a_rate_that_rises_with_the_argument_and_the_users_kwargs_are_not_judged(tmp_path):
    # half the argument rises with it; a second rate the user set with --kwargs stays what they set in the rebuild
    assert run("HalfRateAttention")["dropout"].status is Status.PASS
    f = tmp_path / "extra.py"
    f.write_text("import torch.nn as nn\nfrom zoo_training import TrainBlock\n\n\n"
                 "class ExtraRate(TrainBlock):\n"
                 "    def __init__(self, d_model=32, n_heads=4, dropout=0.1, ffn_dropout=0.1):\n"
                 "        super().__init__(d_model, n_heads, dropout)\n"
                 "        self.ffn_drop = nn.Dropout(ffn_dropout)\n\n"
                 "    def ffn(self, h):\n"
                 "        return self.ffn_drop(super().ffn(h))\n")
    import tblock_cli

    report = tblock_cli.check(f"{f}:ExtraRate", d_model=32, n_heads=4, kwargs={"ffn_dropout": 0.3}, only="dropout")
    assert report.checks[0].status is Status.PASS, report.checks[0]


def test_a_weights_mask_shared_by_the_batch_is_not_an_activations():
    # DropConnect's mask is drawn for a weight, (d_model, hidden): no sequence axis, so not a shared activation mask
    c = run("DropConnect")["dropout"]
    assert c.status is Status.PASS and c.kind == "dropout.unbiased", c
    shared = run("BatchSharedMask")["dropout"]
    assert shared.facts["shapes"] == [[1, 10, 32]], shared.facts


def test_a_rate_taken_and_never_applied_is_warned_and_a_block_without_dropout_modules_is_not():
    """Built with dropout 0.1, nothing drops in training: its nn.Dropout is defined and never called. A block that keeps
    no dropout module (written for dropout 0) says nothing of a rate it ignores, and is not judged so."""
    c = run("RateIgnored")["dropout"]
    assert c.status is Status.WARN and c.kind == "dropout.never_applied" and c.facts["modules"] == ["drop"], c
    assert c.facts["rate"] == 0.1
    assert run("TrainBlock", spec_file="zoo_training.py")["dropout"].status is Status.PASS
    assert run("NoDropoutModules", spec_file="zoo_dropout.py")["dropout"].kind == "dropout.torch_only"
