"""The third generation (issue 20): each class of bug real projects shipped caught by the check that names its class,
and correct blocks in the same styles left clean."""

import pytest
import torch

from tblock_cli.checks import Status, run_checks
from tblock_cli.checks.positions import paper_slopes, toeplitz_error
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

import zoo
from conftest import zoo_spec

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}
THIRD = ("padding", "train_state", "copy", "train_eval", "attention", "norms", "relative", "position_bias", "names")


def battery(name, dtype=torch.float32, only=None, **flags):
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # a flag's "dtype" names the run dtype
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    subject = make_subject(cfg, CPU, dtype, zoo_spec(name), same_shape=False)
    report = run_checks(subject, cfg, CPU, dtype, only=only)
    return {c.name: c for c in report.checks}


@pytest.mark.parametrize("name", sorted(zoo.PLANTED_3))
def test_third_generation_bug_is_caught_by_its_class(name):
    check, flags = zoo.PLANTED_3[name]
    by = battery(name, only=(check,), **flags)
    assert by[check].status in BAD, by[check]


@pytest.mark.parametrize("name", sorted(zoo.CORRECT_3))
def test_correct_third_generation_block_passes_everything(name):
    by = battery(name, **zoo.CORRECT_3[name])
    assert not [c for c in by.values() if c.status in BAD], list(by.values())


@pytest.mark.parametrize("name", sorted(zoo.CORRECT_3))
@pytest.mark.parametrize("dtype,d_model", [(torch.bfloat16, 32), (torch.float32, 64)])
def test_correct_third_generation_block_is_clean_in_the_new_checks(name, dtype, d_model):
    by = battery(name, dtype, only=THIRD, d_model=d_model, **zoo.CORRECT_3[name])
    assert not [c for c in by.values() if c.status in BAD], list(by.values())


def test_toeplitz_error_is_zero_for_a_function_of_i_minus_j_and_sees_one_entry_moved():
    i = torch.arange(6, dtype=torch.float64)
    z = torch.cos(0.7 * (i[:, None] - i[None, :]))[None] + 5.0 * i[:, None]  # a row offset is invisible to softmax
    assert toeplitz_error(z) < 1e-12
    z[0, 4, 1] += 0.5  # on the diagonal i - j = 3 with two others: 2/3 of the move off their mean
    assert toeplitz_error(z) == pytest.approx(0.5 * 2 / 3 / z.abs().max().item(), rel=1e-6)


def test_paper_slopes_are_alibis():
    assert paper_slopes(8) == [2 ** -k for k in range(1, 9)]
    assert paper_slopes(4) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    assert paper_slopes(6) == paper_slopes(4) + paper_slopes(8)[0::2][:2]


def test_measured_slopes_of_a_correct_alibi_are_the_papers():
    by = battery("Alibi3", only=("position_bias",), **zoo.CORRECT_3["Alibi3"])
    assert by["position_bias"].kind == "position_bias.alibi"
    assert by["position_bias"].facts["slopes"] == pytest.approx(paper_slopes(4), rel=1e-4)


@pytest.mark.parametrize("heads", [6, 12])
def test_the_papers_slopes_for_a_head_count_not_a_power_of_two_are_alibi(heads):
    """Two interleaved geometric runs (BLOOM-176B's 112 heads): the paper's set, not a non-geometric bug."""
    by = battery("Alibi3", only=("position_bias",), **{**zoo.CORRECT_3["Alibi3"], "d_model": 8 * heads, "n_heads": heads})
    assert by["position_bias"].kind == "position_bias.alibi", by["position_bias"].detail
    assert by["position_bias"].facts["slopes"] == pytest.approx(paper_slopes(heads), rel=1e-4)


@pytest.mark.parametrize("scaled", [True, False])
def test_a_scale_folded_into_q_before_a_rotate_half_rotary_counts(scaled):
    """ESM-2: q scaled, then rotated by halves (chunk, negate, concatenate): scaled scores, not a warning; the same
    block without the scale still warns unscaled."""
    from zoo_layouts import ScaledBeforeRotateHalf

    import tblock_cli

    c = tblock_cli.check(ScaledBeforeRotateHalf(scaled=scaled), d_model=64, n_heads=4, positional=True, only=["attention"],
                         threads=1).checks[0]
    assert (c.status.value, c.kind) == (("pass", "attention.stats") if scaled else ("warn", "attention.unscaled")), c


def test_left_padding_failure_names_both_explanations_for_a_positional_block():
    by = battery("AbsPosNoRestart", only=("padding",), **zoo.PLANTED_3["AbsPosNoRestart"][1])
    assert by["padding"].kind == "padding.differs_alone" and by["padding"].facts["side"] == "left"
    assert "not derived from the mask" in by["padding"].detail and "relative scheme is broken" in by["padding"].detail


def test_left_padded_nan_from_torch_mha_is_reported_not_failed():
    """nn.MultiheadAttention's own NaN at a fully masked row (PyTorch's behaviour) is information, not a failure."""
    by = battery("Good", only=("padding",), causal=True)
    assert by["padding"].status == Status.PASS
    assert any(n.get("twice") for n in by["padding"].facts["nonfinite"])


def test_names_contradiction_names_both_projections():
    c = battery("ActOnUp", only=("names",))["names"]
    assert c.kind == "names.contradict"
    assert c.facts["wrong"] == [{"name": "gate_proj", "role": "ffn.in", "promised": "ffn.gate"}]
    assert [h["name"] for h in c.facts["holders"]] == ["up_proj"]
    assert battery("ActAfterProduct", only=("names",))["names"].facts["pairs"] == [["gate_proj", "up_proj"]]


def test_eval_only_path_names_the_parameters_eval_never_touches():
    c = battery("EvalReturnsEarly", only=("train_eval",))["train_eval"]
    assert c.kind == "train_eval.eval_unused"
    assert sorted(c.facts["params"]) == ["down_proj.weight", "ffn_norm.weight", "gate_proj.weight", "up_proj.weight"]


def test_a_functional_dropout_is_removed_by_rebuilding_with_dropout_zero():
    """Rel3's residual dropout is a plain float `p` that zeroing *drop* attributes cannot find: train forwards stay
    random unless the block is rebuilt through its constructor with dropout=0."""
    c = battery("Rel3", only=("train_eval",), dropout=0.1)["train_eval"]
    assert c.kind == "train_eval.agree" and c.facts["rebuilt"] is True


def test_safety_failures_name_their_cause_and_skip_what_they_spoil():
    by = battery("TrainRunningStat", only=("train_state", "copy", "train_eval", "dtype"))
    assert by["train_state"].kind == "train_state.second_backward" and by["train_state"].facts["step"] == 2
    assert by["train_eval"].kind == "needs.train_safe"
    by = battery("ClosureCapture", only=("copy", "dtype", "train_eval"))
    assert by["copy"].kind == "copy.unfaithful" and "ffn_norm" in by["copy"].facts["shared"]
    assert by["dtype"].kind == "needs.copyable" and by["train_eval"].kind == "needs.copyable"
    held = battery("TrainStateHistory", only=("train_state",))["train_state"]
    assert held.kind == "train_state.history" and held.facts["held"] == ["k_cache"]


def test_alibi_scale_is_judged_on_qk_alone():
    """ALiBi's bias spreads the scores (x2.3 at d_model 512 when counted); the q.k part alone is scaled."""
    c = battery("Alibi3", only=("attention",), d_model=64, **zoo.CORRECT_3["Alibi3"])["attention"]
    assert 0.8 < c.value < 1.3, c


class TrainNoise(torch.nn.Module):
    """Gaussian noise in train mode, not a dropout: zeroing dropout leaves the train forward random."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.ff = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.ff(x + 0.1 * torch.randn_like(x) if self.training else x)


class TrainScaled(TrainNoise):
    """A deterministic train-only path: the output scaled in train mode alone."""

    def forward(self, x):
        return (x + self.ff(x)) * (1.1 if self.training else 1.0)


def test_train_eval_tells_a_random_train_forward_from_a_different_one():
    import tblock_cli

    noisy = tblock_cli.check(TrainNoise(), d_model=32, n_heads=4, threads=1, only=["train_eval"]).checks[0]
    assert noisy.status == Status.SKIP and noisy.kind == "train_eval.random_train", noisy
    scaled = tblock_cli.check(TrainScaled(), d_model=32, n_heads=4, threads=1, only=["train_eval"]).checks[0]
    assert scaled.status == Status.FAIL and scaled.kind == "train_eval.differs", scaled
    # max|1.1 y - y| / max|y| (max|y| > 1): the 10 % train-only scale, exactly where |y| is largest
    assert abs(scaled.value - 0.1) < 1e-6, scaled


@pytest.mark.parametrize("name", ["Alibi3", "AlibiWrongSlopes", "AlibiSlopesReversed", "AlibiBeforeScale", "AlibiHalved",
                                  "Rel3", "GQA3", "Gemma3"])
def test_position_bias_reads_relatives_scores_first_and_decides_as_alone(name, monkeypatch):
    """After relative, a block whose identical-token scores are a multiple of q.k needs no position_bias forward (RoPE
    blocks); one with a bias runs the two-input probe as alone, and the verdict is the same either way."""
    from tblock_cli.checks import positions

    flags = zoo.CORRECT_3.get(name) or zoo.PLANTED_3[name][1]
    alone = battery(name, only=("position_bias",), **flags)["position_bias"]
    probed = []
    real = positions.head_biases
    monkeypatch.setattr(positions, "head_biases", lambda ctx: probed.append(1) or real(ctx))
    after = battery(name, only=("relative", "position_bias"), **flags)["position_bias"]
    assert (after.status, after.kind) == (alone.status, alone.kind)
    assert bool(probed) == name.startswith("Alibi"), (name, after)



def test_shortcuts_keep_their_checks_on_unusual_shapes():
    """finite's special inputs run side by side and only their finiteness is read: an output laid out (T, B, d) is not
    split per input (TransposedOutput fails shape alone). position_bias after relative leaves a non-square call
    (cross-attention to 5 latents) unjudged, as its own probe does."""
    out = battery("TransposedOutput", only=("shape", "finite"))
    assert out["shape"].status == Status.FAIL and out["finite"].status == Status.PASS, out["finite"]
    cross = battery("CrossToLatents", only=("relative", "position_bias"))
    assert cross["position_bias"].kind == "position_bias.none", cross["position_bias"]


class LargeRelativeBias(torch.nn.Module):
    """Correct: scores q.k / sqrt(d_head) plus a learned bias per head and distance 8x their std (x-transformers scales
    its relative bias by sqrt(d_head)); `scaled=False` leaves the 1/sqrt(d_head) out."""

    def __init__(self, d_model=32, n_heads=4, scaled=True):
        super().__init__()
        self.n, self.scaled = n_heads, scaled
        self.norm = torch.nn.LayerNorm(d_model)
        self.qkv, self.out = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)
        self.bias = torch.nn.Parameter(8.0 * torch.randn(n_heads, 64))

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.n, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, dim=-1))
        dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs()
        s = q @ k.transpose(-2, -1)
        s = (s / (d // self.n) ** 0.5 if self.scaled else s) + self.bias[:, dist]
        return x + self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d))


@pytest.mark.parametrize("seed", [0, 1, 3, 5])
def test_the_scale_is_read_through_a_large_learned_bias_whatever_the_seed(seed):
    """The q.k part's slope comes from the two samples' difference, where the bias cancels: the plain regression over 10
    tokens read ratios of 0.27 to 3.3 on x-transformers' relative bias, depending on the seed."""
    import tblock_cli

    torch.manual_seed(seed)
    ok = tblock_cli.check(LargeRelativeBias(), d_model=32, n_heads=4, threads=1, seed=seed, only=["attention"]).checks[0]
    assert ok.kind == "attention.stats" and 0.8 < ok.value < 1.25, ok
    torch.manual_seed(seed)
    raw = tblock_cli.check(LargeRelativeBias(scaled=False), d_model=32, n_heads=4, threads=1, seed=seed, only=["attention"]).checks[0]
    assert raw.kind == "attention.unscaled" and raw.value > 2.0, raw


def test_position_bias_alone_pays_the_identical_token_probe_itself(monkeypatch):
    """Whichever check asks first pays: alone, position_bias computes the identical-token probe relative would have,
    so a RoPE block (scores a multiple of q.k) needs no bias probe of its own either way."""
    from tblock_cli.checks import positions

    probed = []
    real = positions.head_biases
    monkeypatch.setattr(positions, "head_biases", lambda ctx: probed.append(1) or real(ctx))
    alone = battery("Rel3", only=("position_bias",), **zoo.CORRECT_3["Rel3"])["position_bias"]
    assert alone.kind == "position_bias.none" and not probed, alone


class _GainFirstLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):  # the gain before the statistics: LayerNorm of (x * w), then the bias
        return torch.nn.functional.layer_norm(x * self.weight, self.normalized_shape, None, None, self.eps) + self.bias


class _OffsetRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):  # Gemma's (1 + w): the gain acts after normalising, only offset
        return torch.nn.functional.rms_norm(x, self.normalized_shape, None, self.eps) * (1 + self.weight)


@pytest.mark.parametrize("norm,inside", [(torch.nn.LayerNorm(16), False), (torch.nn.RMSNorm(16), False),
                                         (_OffsetRMSNorm(16), False), (_GainFirstLayerNorm(16), True)])
def test_a_norm_with_its_gain_redrawn_is_a_per_channel_affine_map_of_itself_unless_the_gain_comes_first(norm, inside):
    from tblock_cli.checks.norms import AFFINE_TOL, _affine_residual

    if isinstance(norm, _OffsetRMSNorm):
        torch.nn.init.zeros_(norm.weight)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    affine, linear = _affine_residual(norm, x, 16, torch.Generator().manual_seed(1))
    # the fit is exact for a gain and bias per channel; a gain inside the statistics mixes channels through them
    assert (affine > 100 * AFFINE_TOL) if inside else (affine < 1e-12), affine
    assert inside or linear < 1e-12, linear  # and the output is linear in those parameters


def test_a_parameter_swapped_for_a_while_leaves_the_original_objects_and_versions():
    from tblock_cli.probes import parameters_swapped, state_key

    m = torch.nn.LayerNorm(4)
    before, key = m.weight, state_key(m)
    with parameters_swapped({(m, "weight"): torch.nn.Parameter(torch.full((4,), 2.0))}):
        assert m(torch.ones(1, 4) * torch.arange(4.0)).abs().max() > 2.5  # the swapped gain is the one used
    assert m.weight is before and state_key(m) == key


def test_a_norm_named_for_scaling_its_input_first_is_not_judged_for_it():
    """MuseSpark's InputScaledRMSNorm multiplies by (1 + w) before it normalises, by design and by name: the same code
    under a plain RMSNorm name warns."""
    import zoo_norms

    class InputScaledRMSNorm(zoo_norms.GainFirstRMSNorm):
        pass

    class Named(zoo_norms.GainBeforeStatistics):
        def __init__(self, d_model=64, n_heads=4, d_ff=None, dropout=0.0, causal=True):
            super().__init__(d_model, n_heads, d_ff, dropout, causal)
            self.attn_norm, self.ffn_norm = InputScaledRMSNorm(d_model), InputScaledRMSNorm(d_model)

    import tblock_cli

    for block, status in ((Named(32, 4), Status.PASS), (zoo_norms.GainBeforeStatistics(32, 4), Status.WARN)):
        c = tblock_cli.check(block, d_model=32, n_heads=4, threads=1, only="norms").checks[0]
        assert c.status == status, c.detail


def test_a_norm_whose_variance_cancels_under_a_large_mean_fails_and_two_passes_do_not():
    """Tokens of spread 1 shifted by 1e3 in every channel: a LayerNorm's output must not move; the one-pass variance
    E[x^2] - E[x]^2 in float32 moves it by ~5e-2 (its own float32 upcast hides it from a float64 copy); torch's
    LayerNorm and the two-pass one written out move it by < 1e-4; an RMSNorm, not invariant to a shift, is not judged."""
    import zoo_norms

    import tblock_cli

    for block, status in ((zoo_norms.OnePassVarianceNorm(32, 4), Status.FAIL), (zoo_norms.HandLayerNormBlock(32, 4), Status.PASS),
                          (zoo.Good(32, 4), Status.PASS), (zoo.LlamaBlock(32, 4), Status.PASS)):
        c = tblock_cli.check(block, d_model=32, n_heads=4, threads=1, only="norms").checks[0]
        assert c.status == status, c.detail
        if status == Status.FAIL:
            assert c.kind == "norms.shifted" and c.facts["shifted"][0]["error"] > 1e-2, c.facts


def test_a_gain_applied_twice_warns_and_norms_linear_in_their_parameters_pass():
    """A norm's gain and bias enter linearly (x * w + b, Gemma's x * (1 + w)): with them at the midpoint of two draws,
    the output is the midpoint of the two outputs. (y * w) * w is per-channel affine for any one draw, the same at
    unit gain, and off that midpoint by (w1 - w2)^2 / 4 against (w1^2 - w2^2): a few percent for draws of +-0.5."""
    import zoo_norms

    import tblock_cli

    for block, status in ((zoo_norms.GainAppliedTwice(32, 4), Status.WARN), (zoo_norms.HandLayerNormBlock(32, 4), Status.PASS),
                          (zoo.Good(32, 4), Status.PASS), (zoo.LlamaBlock(32, 4), Status.PASS), (zoo.Gemma3(32, 4), Status.PASS)):
        c = tblock_cli.check(block, d_model=32, n_heads=4, threads=1, only="norms").checks[0]
        assert c.status == status, (type(block).__name__, c.detail)
        if status == Status.WARN:
            assert c.kind == "norms.gain_not_linear" and c.facts["not_linear"][0]["residual"] > 1e-2, c.facts


def test_an_eps_that_is_zero_in_float16_warns_where_the_norm_computes_in_float16():
    """BERT's TF-style LayerNorm in the input's dtype, eps 1e-12: 0 in float16 (its smallest step is 6e-8), so a
    constant token gives 0 / 0. The same norm with eps 1e-6, one with float32 statistics, torch's LayerNorm with
    eps 1e-12 (its kernel accumulates in float32) and an RMS norm through F.normalize (0 / 0 only at the zero token,
    which the probe leaves alone) return finite tokens."""
    import zoo_norms

    import tblock_cli

    class Eps6(zoo_norms.HandLayerNormBlock):
        norm = staticmethod(lambda d: zoo_norms.BertLayerNorm(d, eps=1e-6))

    class NormalizeRMSNorm(torch.nn.Module):  # x-transformers' idiom: F.normalize (eps 1e-12) * sqrt(d) * g
        def __init__(self, d):
            super().__init__()
            self.scale, self.g = d ** 0.5, torch.nn.Parameter(torch.ones(d))

        def forward(self, x):
            return torch.nn.functional.normalize(x, dim=-1) * self.scale * self.g

    class Normalized(zoo_norms.HandLayerNormBlock):
        norm = NormalizeRMSNorm

    for block, status in ((zoo_norms.EpsVanishesInHalf(32, 4), Status.WARN), (Eps6(32, 4), Status.PASS),
                          (Normalized(32, 4), Status.PASS),
                          (zoo_norms.HandLayerNormBlock(32, 4), Status.PASS), (zoo.Good(32, 4, eps=1e-12), Status.PASS)):
        c = tblock_cli.check(block, d_model=32, n_heads=4, threads=1, only="norms").checks[0]
        assert c.status == status, (type(block).__name__, c.detail)
        if status == Status.WARN:
            assert c.kind == "norms.half_eps" and {n["got"] for n in c.facts["half_nan"]} == {"NaN"}, c.facts


def test_values_rotated_and_never_rotated_back_are_named_and_vo_rope_is_not():
    # both rotate v at its positions (the values of identical tokens differ by position); with each query attending
    # to itself, VO-RoPE's rotation back returns the same row everywhere, the slip leaves them rotated
    c = battery("ValuesRotatedSDPA", only=("relative",), **zoo.POS)["relative"]
    assert c.kind == "relative.values_positioned" and c.facts["values"] > 0.1 and c.value > 0.1, c
    c = battery("RoPEValuesSDPA", only=("relative",), **zoo.POS)["relative"]
    assert c.kind == "relative.toeplitz", c


def test_rows_spread_reads_the_middle_half_against_the_largest_entry():
    from tblock_cli.anatomy.attention import rows_spread

    t = torch.ones(8, 4, dtype=torch.float64)
    assert rows_spread(t) == 0.0
    t[3, 1] += 0.5  # inside the middle half (rows 2..5): 0.5 of the largest entry, 1.5
    assert rows_spread(t) == pytest.approx(0.5 / 1.5)
    t[0, 0] = 100.0  # outside it (a convolution's zero padding reaches the ends): only the scale moves
    assert rows_spread(t) == pytest.approx(0.5 / 100.0)
