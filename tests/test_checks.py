"""Each check on blocks that pass it and on blocks with a planted bug that it must catch."""

import pytest
import torch
import torch.nn.functional as F

import tblock_cli
from tblock_cli.checks import CHECK_NAMES, CheckReport, Status, run_checks
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

import zoo
from conftest import zoo_spec

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def battery(name=None, dtype=torch.float32, **flags):
    """The report of a fresh block; the same block, dtype and flags share one run (reports are only read)."""
    flags = {"d_model": 32, "n_heads": 4, **flags}
    key = (name, dtype, tuple(sorted(flags.items())))
    if key not in _reports:
        torch.manual_seed(0)  # as the autouse fixture seeds each test: a shared report is the one it would get
        cfg = build_config(**flags)
        spec = zoo_spec(name) if name else None
        subject = make_subject(cfg, CPU, dtype, spec, same_shape=False)
        report = run_checks(subject, cfg, CPU, dtype)
        _reports[key] = report, {c.name: c for c in report.checks}
    return _reports[key]


_reports: dict = {}


def test_every_need_is_established_once_by_an_earlier_check():
    from tblock_cli.checks import REGISTRY

    assert len(set(CHECK_NAMES)) == len(CHECK_NAMES)
    setters = [c.establishes for c in REGISTRY if c.establishes]
    assert len(setters) == len(set(setters))
    order = {c.establishes: i for i, c in enumerate(REGISTRY) if c.establishes}
    for i, c in enumerate(REGISTRY):
        for need in c.needs:
            assert need in order and order[need] < i, (c.name, need)


def test_docs_table_of_checks_is_the_registry():
    from pathlib import Path

    from tblock_cli.checks.battery import docs_table

    docs = (Path(__file__).parent.parent / "docs" / "checks.md").read_text()
    assert docs_table() in docs, "docs/checks.md's table differs from the registry; paste checks.battery.docs_table()"


@pytest.mark.parametrize("flags", [
    {}, {"norm": "post"}, {"causal": True}, {"activation": "relu", "d_ff": 48}, {"bias": False},
    {"layers": 3}, {"layers": 2, "norm": "post", "causal": True}, {"batch": 5, "seq": 5},
])
def test_builtin_block_passes_everything(flags):
    report, by = battery(**flags)
    assert report.ok
    assert not [c for c in report.checks if c.status in BAD], report.checks
    assert by["reference"].status == Status.PASS
    assert by["causal"].status == (Status.PASS if flags.get("causal") else Status.SKIP)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_builtin_block_passes_in_half_precision(dtype):
    report, _ = battery(dtype=dtype, norm="post")
    assert not [c for c in report.checks if c.status in BAD], report.checks


@pytest.mark.parametrize("name", sorted(zoo.CORRECT))
@pytest.mark.parametrize("d_model", [32, 64])
def test_correct_user_blocks_raise_no_alarm(name, d_model):
    report, by = battery(name, d_model=d_model, **zoo.CORRECT[name])
    assert not [c for c in report.checks if c.status in BAD], report.checks
    assert by["reference"].status == Status.SKIP  # a user block has no reference


@pytest.mark.parametrize("name", sorted(zoo.PLANTED_2))
@pytest.mark.parametrize("size", [{}, {"d_model": 64, "n_heads": 4, "d_ff": 256}])
def test_second_generation_bug_is_caught_under_strict(name, size):
    """Each class of issue 11 fails, or warns (so --strict fails), whether or not the block takes a mask."""
    check, flags = zoo.PLANTED_2[name]
    report, by = battery(name, **{**size, **flags})
    assert by[check].status in (Status.FAIL, Status.WARN), by[check]
    assert not CheckReport(report.checks, strict=True).ok


def test_heads_merged_without_transpose_is_caught_without_a_mask():
    _, by = battery("HeadsNoTransposeNoMask")
    assert by["padding"].status == Status.SKIP and by["order"].status == Status.WARN
    assert "--positional" in by["order"].detail


def test_unscaled_scores_at_512_and_8_heads():
    _, by = battery("Unscaled", d_model=512, n_heads=8)
    assert by["attention"].status == Status.WARN and 6 < by["attention"].value < 11  # sqrt(64) = 8 when unscaled
    _, ok = battery("HandSoftmax", d_model=512, n_heads=8)
    assert ok["attention"].status == Status.PASS and 0.7 < ok["attention"].value < 1.4


def test_positional_declared_or_found_skips_order():
    _, by = battery("Good", positional=True)
    assert by["order"].status == Status.SKIP and "--positional" in by["order"].detail
    _, rope = battery("RoPEBlock")
    assert rope["order"].status == Status.SKIP and "rotary" in rope["order"].detail


def test_pad_keyword_and_pad_means_reach_the_block():
    _, skipped = battery("XKeepMask")
    assert skipped["padding"].status == Status.SKIP and "--pad-keyword" in skipped["padding"].detail
    _, wrong = battery("XKeepMask", pad_keyword="mask")  # True = keep read as True = pad
    assert wrong["padding"].status == Status.FAIL
    _, right = battery("XKeepMask", pad_keyword="mask", pad_means="keep")
    assert right["padding"].status == Status.PASS


def test_one_cause_one_failure():
    """Random eval outputs fail determinism only; the checks comparing two forwards skip and say why."""
    _, by = battery("DropoutInEval")
    assert by["determinism"].status == Status.FAIL
    for name in ("batch", "padding", "dtype", "order", "train_eval"):
        assert by[name].status == Status.SKIP and "random in eval" in by[name].detail, by[name]
    _, nan = battery("NaNForward")
    assert nan["finite"].status == Status.FAIL
    for name in ("residual", "batch", "padding", "determinism", "dtype", "grad_input"):
        assert nan[name].status == Status.SKIP and "not finite" in nan[name].detail, nan[name]
    assert not [c for c in nan.values() if c.status == Status.PASS and c.name in ("residual", "batch", "padding")]


@pytest.mark.parametrize("name", zoo.CACHED_CORRECT)
def test_correct_cached_blocks_pass_kv_cache(name):
    _, by = battery(name, causal=True)
    assert by["kv_cache"].status == Status.PASS, by["kv_cache"]


@pytest.mark.parametrize("name", zoo.CACHE_BUGS)
def test_cache_bugs_fail_kv_cache(name):
    _, by = battery(name, causal=True)
    assert by["kv_cache"].status == Status.FAIL, by["kv_cache"]
    # decoded in turns, the failing sequence again alone: a cache kept on the module is told from a wrong cache
    # (CachePromptByLength's prompts stay on the module: decoded again alone, the sequence still gets the other's)
    kind = {"CacheShared": "kv_cache.shared", "CacheGrowsGraph": "kv_cache.graph"}.get(name, "kv_cache.differs")
    assert by["kv_cache"].kind == kind, by["kv_cache"]


def test_builtin_block_decodes_like_its_forward():
    for flags in ({"causal": True}, {"causal": True, "norm": "post"}, {"causal": True, "layers": 3}):
        _, by = battery(**flags)
        assert by["kv_cache"].status == Status.PASS, (flags, by["kv_cache"])
    _, by = battery()
    assert by["kv_cache"].status == Status.SKIP and "--causal" in by["kv_cache"].detail
    _, by = battery("Good", causal=True)
    assert by["kv_cache"].status == Status.SKIP and "decode" in by["kv_cache"].detail


def test_no_pad_keyword_skips_padding():
    _, by = battery("NoPadKeyword")
    assert by["padding"].status == Status.SKIP and "pad_mask" in by["padding"].detail


@pytest.mark.parametrize("name", sorted(zoo.PLANTED))
def test_planted_bug_is_caught(name):
    check, flags = zoo.PLANTED[name]
    report, by = battery(name, **flags)
    assert by[check].status == Status.FAIL, by[check]
    assert not report.ok


@pytest.mark.parametrize("name", sorted(zoo.WARNED))
def test_warned_bug_is_a_warning_and_fails_under_strict(name):
    check = zoo.WARNED[name]
    report, by = battery(name)
    assert by[check].status == Status.WARN, by[check]
    assert [c.name for c in report.checks if c.status != Status.PASS and c.status != Status.SKIP] == [check]
    assert report.ok and not CheckReport(report.checks, strict=True).ok


def test_need_weights_left_on_warns_with_the_bytes():
    report, by = battery("NeedWeightsOn")
    c = by["need_weights"]
    assert c.status == Status.WARN
    assert c.value == 2 * 10 * 10 * 4  # (B, L, S) float32, averaged over heads
    assert report.ok and not run_checks(report_subject("NeedWeightsOn"), build_config(d_model=32, n_heads=4), CPU, torch.float32, strict=True).ok


def report_subject(name):
    return make_subject(build_config(d_model=32, n_heads=4), CPU, torch.float32, zoo_spec(name))


def test_unused_layer_is_named():
    _, by = battery("UnusedLayer")
    assert "proj.weight" in by["grad_params"].detail and by["grad_params"].value == "12/14"


def test_residual_gain_values():
    _, pre = battery()
    _, post = battery(norm="post")
    _, none = battery("NoResidual")
    assert 0.95 < pre["residual"].value < 1.05
    assert 0.8 < post["residual"].value < 1.0
    assert abs(none["residual"].value) < 0.2


def test_residual_per_layer_names_the_bad_layer():
    cfg = build_config(d_model=32, n_heads=4, layers=3)
    subject = make_subject(cfg, CPU, torch.float32)
    layer = subject.module.layers[1]
    layer.forward = lambda x, pad_mask=None: layer.ffn(layer.ln2(x))  # plant: layer 1 loses both residuals
    by = {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32).checks}
    assert by["residual"].status == Status.FAIL and "layer 1" in by["residual"].detail


def test_reference_catches_a_weight_mismatch():
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32)
    subject.module.ffn.act = torch.nn.ReLU()  # plant: the module says gelu, computes relu
    by = {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32).checks}
    assert by["reference"].status == Status.FAIL


def test_fully_padded_sequence_is_reported_not_failed():
    _, by = battery()
    assert by["padding"].status == Status.PASS
    assert "fully padded row gives" in by["padding"].detail


def test_norm_placement_names_the_sublayer_that_reads_an_unnormalised_stream():
    _, by = battery("NoNormBeforeFFN")
    assert by["norm_placement"].status == Status.WARN and "ffn.0" in by["norm_placement"].detail
    _, post = battery(norm="post")
    assert post["norm_placement"].status == Status.PASS and "Post-LN" in post["norm_placement"].detail
    _, none = battery("AttentionOnly")
    assert none["norm_placement"].status == Status.PASS  # its one norm sits before the attention
    _, bare = battery("NoPadKeyword")
    assert bare["norm_placement"].status == Status.PASS


def test_attention_axis_diagonal_and_overscaling():
    _, axis = battery("SoftmaxQueryAxisBidirectional")
    assert axis["attention"].status == Status.FAIL and "query axis" in axis["attention"].detail
    _, over_heads = battery("SoftmaxHeadAxisBidirectional")  # said as what it is, not as the query axis
    assert over_heads["attention"].status == Status.FAIL and over_heads["attention"].facts["axis"] == "head"
    assert "head axis" in over_heads["attention"].detail
    _, diag = battery("DiagonalMasked", causal=True)
    assert diag["attention"].status == Status.WARN and "attends to itself" in diag["attention"].detail
    _, first_open = battery("DiagonalMaskedFirstOpen", causal=True)  # the first row reopened: the others still blind
    assert first_open["attention"].kind == "attention.self_masked", first_open["attention"].detail
    _, twice = battery("SoftmaxTwice")  # the scores' scale is right: the weights were flattened after the softmax
    assert twice["attention"].kind == "attention.reweighted" and twice["attention"].value < 0.2, twice["attention"].detail
    _, d_model = battery("ScaledByDModel", d_model=64, n_heads=4)
    assert d_model["attention"].status == Status.WARN and 0.4 < d_model["attention"].value < 0.6  # 1/sqrt(4 heads)


def test_residual_doubled_or_taken_after_the_norm_fails():
    _, twice = battery("ResidualTwice")
    assert twice["residual"].status == Status.FAIL and 1.9 < twice["residual"].value < 2.1
    _, normed = battery("ResidualFromNorm")
    assert normed["residual"].status == Status.FAIL and "doubling the input" in normed["residual"].detail


def test_linear_ffn_names_both_modules():
    _, by = battery("LinearFFN")
    assert by["ffn_share"].status == Status.WARN and "`ffn.0` and `ffn.2` compose to one linear map" in by["ffn_share"].detail


def test_ffn_share_against_the_rule():
    _, by = battery(d_model=64, n_heads=4)
    assert by["ffn_share"].value == pytest.approx(2 / 3, abs=0.01)
    _, by = battery(d_model=64, n_heads=4, d_ff=128)  # r = 2: 2r / (4 + 2r) = 1/2
    assert by["ffn_share"].value == pytest.approx(0.5, abs=0.01) and "not 2" in by["ffn_share"].detail
    _, by = battery("AttentionOnly")
    assert by["ffn_share"].status == Status.SKIP and "no FFN" in by["ffn_share"].detail
    _, by = battery("LlamaBlock", causal=True)  # SwiGLU of width 8/3 d: 3 * 8/3 d^2 = 8 d^2, 2/3 again
    assert by["ffn_share"].value == pytest.approx(2 / 3, abs=0.01)


def test_a_raising_check_becomes_error_and_others_run():
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32)
    calls = {"n": 0}
    real = subject.module.forward

    def flaky(x, pad_mask=None):
        calls["n"] += 1
        if pad_mask is not None:
            raise RuntimeError("mask path broken")
        return real(x)

    subject.module.forward = flaky
    by = {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32).checks}
    assert by["padding"].status == Status.ERROR and "mask path broken" in by["padding"].detail
    assert by["determinism"].status == Status.PASS


def test_causal_skip_still_says_what_the_block_does():
    import tblock_cli

    class MaskedSilently(torch.nn.Module):  # causal by its code alone: no switch, no name says so
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x):
            q, k, v = (t.view(*x.shape[:2], 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)

    silent = tblock_cli.check(MaskedSilently(), d_model=32, n_heads=4, threads=1, only="causal").checks[0]
    _, builtin = battery()
    assert silent.status == builtin["causal"].status == Status.SKIP
    assert "ignore later positions" in silent.detail
    assert "depend on later positions" in builtin["causal"].detail
    # a block that says it is causal (LlamaBlock's causal=True default) is held to it without the flag
    _, llama = battery("LlamaBlock")
    assert llama["causal"].status == Status.PASS and "the block says it is causal" in llama["causal"].detail


def test_a_bias_added_to_the_probabilities_is_no_softmax_and_the_same_bias_on_the_scores_is_one():
    """The weights reaching the values came from a softmax, then a relative bias was added: rows sum 0.85 to 1.17.
    The same bias added to the scores is Swin's design, and its table, held by the block itself, is attention's for
    ffn_share (it reaches the scores and no projection before them): 1.0 % of a d_model-64 block, warned before."""
    import tblock_cli
    from tblock_cli.anatomy.calls import reshaped_after_softmax

    bad = tblock_cli.check(zoo.RelativeBiasOnProbabilities(64, 4), d_model=64, n_heads=4, only=["attention"]).checks[0]
    assert bad.status.value == "warn" and bad.kind == "attention.no_softmax", bad
    good = tblock_cli.check(zoo.RelativeBiasBeforeSoftmax(64, 4), d_model=64, n_heads=4, only=["attention", "ffn_share"])
    assert [c.status.value for c in good.checks] == ["pass", "pass"], good.checks
    assert good.checks[1].facts["scoring"] == ["rel"], good.checks[1].facts
    p = torch.rand(2, 3, 5, 5).softmax(-1)
    assert not reshaped_after_softmax(p) and not reshaped_after_softmax(p[..., :4])  # sinks sliced off: rows under 1
    assert not reshaped_after_softmax(p - 0.5 * p.flip(1))  # differential attention: every row 1 - lambda
    assert reshaped_after_softmax(p + 0.05 * torch.rand(5, 5))


def test_a_block_that_refuses_one_token_is_warned_by_shape_and_judged_causal_on_the_rest():
    """A top-k over at least 4 keys (x-transformers' sparse_topk) raises on shorter sequences: `shape` warns, `causal`
    judges the half-sequence prefix and does not error."""
    class TopKAttention(torch.nn.Module):
        def __init__(self, d=32):
            super().__init__()
            self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
                torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), float("-inf"))
            kth = s.topk(4, dim=-1).values[..., -1:]  # raises where fewer than 4 keys exist
            return x + self.o(s.masked_fill(s < kth, float("-inf")).softmax(-1) @ v)

    r = tblock_cli.check(TopKAttention(), d_model=32, n_heads=4, causal=True, threads=1, only="shape,causal")
    by = {c.name: c for c in r.checks}
    assert by["shape"].status == Status.WARN and by["causal"].status == Status.PASS, by


class _Node:
    """An autograd node as torch 2.11 hands it out: each read of next_functions makes new wrapper objects, freed with
    their last reference (so an id() of a dropped one names the next wrapper made)."""

    def __init__(self, depth: int, leaf):
        self._depth, self._leaf = depth, leaf

    @property
    def next_functions(self):
        if self._depth == 0:
            return ((_Leaf(self._leaf), 0),)
        return ((_Node(self._depth - 1, self._leaf), 0), (None, 0))


class _Leaf:
    def __init__(self, variable):
        self.variable = variable
        self.next_functions = ()


def test_graph_walks_reach_every_node_when_wrappers_are_made_anew_on_each_read():
    """reached_parameters and the held-graph walk must hold each node they read: keyed by id() alone, a walk over
    fresh wrappers meets a recycled id and stops after a few nodes (train_eval then failed every block on torch 2.11)."""
    from tblock_cli.checks.graphs import graph_nodes, reaches
    from tblock_cli.checks.paths import reached_parameters

    leaf = torch.zeros(1, requires_grad=True)
    root = _Node(200, leaf)
    assert sum(1 for _ in graph_nodes(root)) == 202
    assert reaches(root, {id(leaf)})

    class Out:
        grad_fn = root

    assert reached_parameters(Out()) == {id(leaf)}
