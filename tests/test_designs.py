"""Correct designs of popular libraries that earlier versions raised alarms on (tests/zoo_designs.py): each clean in the
whole battery, and the property each reading now rests on tested on its own, against a planted bug it must still
catch."""

import math

import pytest
import torch
import torch.nn.functional as F
import zoo_designs

from tblock_cli.anatomy.attention import unit_rows
from tblock_cli.anatomy.dataflow import trace
from tblock_cli.anatomy.norms import find_norms
from tblock_cli.api import check, spec
from tblock_cli.card.attention import COSINE
from tblock_cli.card.own import own_claims
from tblock_cli.checks import Status, run_checks
from tblock_cli.config import build_config
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")
BAD = {Status.FAIL, Status.ERROR, Status.WARN}


def run(name, only=None, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, "causal": True, **flags})
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_designs.py'}:{name}")
    return {c.name: c for c in run_checks(subject, cfg, CPU, torch.float32, only=only).checks}


@pytest.mark.parametrize("name", zoo_designs.CORRECT)
def test_each_design_raises_no_alarm_in_the_whole_battery(name):
    # heads of 64 channels, as x-transformers' default: logits doubled at init (AddedTalkingHeads) are not unscaled
    # ones there (sqrt(64) = 8x); at 8 channels they could not be told apart (2.8x)
    flags = {"causal": False} if name in zoo_designs.BIDIRECTIONAL else {}
    by = run(name, d_model=128, n_heads=2) if name == "AddedTalkingHeadsBlock" else run(name, **flags)
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_unit_rows_tells_cosine_attention_from_an_rms_normed_one():
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    assert unit_rows(F.normalize(q, dim=-1), F.normalize(k, dim=-1))
    assert unit_rows(F.normalize(q, dim=-1), F.normalize(k, dim=-1).transpose(-2, -1))  # q @ k^T's operand
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).sqrt()  # noqa: E731 - rows of norm sqrt(16) = 4
    assert not unit_rows(rms(q), rms(k)) and not unit_rows(q, k)


def test_an_rms_normed_qk_without_its_scale_is_still_warned():
    """The planted bug cosine attention must not hide: q and k RMS-normed (rows of norm sqrt(d_head)), no 1/sqrt(d)."""

    class Unscaled(zoo_designs.CosineAttention):
        def forward(self, h):
            q, k, v = (zoo_designs.heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
            q, k = (F.rms_norm(t, (t.shape[-1],)) for t in (q, k))
            return self.to_out(zoo_designs.merge(zoo_designs.causal_softmax(q @ k.transpose(-2, -1)) @ v))

    m = Unscaled(64, 2)  # head width 32: unscaled scores are sqrt(32) = 5.7x too large
    flow = trace(m, m, torch.randn(2, 12, 64), 64)
    (call,) = flow.attention
    assert call.scale_ratio == pytest.approx(math.sqrt(32), rel=0.05) and call.scale_note.kind == "qk"


def test_cosine_scores_read_their_temperature_and_a_bare_scale_beside_them_claims_nothing():
    r = spec(f"{TESTS / 'zoo_designs.py'}:CosineAttentionBlock", d_model=32, n_heads=4, threads=1)
    e = r.card.get("attn.scale")
    assert e.value == pytest.approx(1 / 10**2, rel=1e-3) and COSINE in e.how  # logits = 10 q.k: 1/sqrt(X) = 10
    said = [c for c in own_claims(list(zoo_designs.CosineAttentionBlock(32, 4).modules())) if c.key == "attn.scale"]
    assert [c.value for c in said] == [pytest.approx(8.0)]  # CosineAttention.scale = 1/sqrt(8): read, set aside
    c = run("CosineAttentionBlock", ("spec",))["spec"]
    assert c.status is Status.PASS and c.facts["matched"] >= 1, (c.kind, c.detail)


@pytest.mark.parametrize("name, why", [("TalkingHeadsBlock", "no one multiple"),
                                       ("AddedTalkingHeadsBlock", "moves with the block's parameters")])
def test_talking_heads_leave_the_scale_unread(name, why):
    r = spec(f"{TESTS / 'zoo_designs.py'}:{name}", d_model=32, n_heads=4, threads=1)
    e = r.card.get("attn.scale")
    assert not e.read and why in e.skip, e


def test_a_fixed_scale_the_block_contradicts_is_still_read_and_failed():
    """The learned-scale reading must not hide the planted bug: `scale` 1/sqrt(d_head) kept, 1/sqrt(d_model) used."""
    c = run_spec_of_claims("ScaleAttributeContradicted")
    assert c.status is Status.FAIL and [d["key"] for d in c.facts["differs"]] == ["attn.scale"], (c.kind, c.detail)


def run_spec_of_claims(name):
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, torch.float32, f"{TESTS / 'zoo_claims.py'}:{name}")
    return run_checks(subject, cfg, CPU, torch.float32, only=("spec",)).checks[0]


def test_a_scalar_gain_norm_is_read_at_the_streams_width():
    m = zoo_designs.ScaleNormBlock(32, 4)
    assert find_norms(m, 32, CPU, torch.float32) == {"attn_norm": 32, "ffn_norm": 32}


def test_an_mlp_over_distances_is_no_unnormed_ffn_while_a_missing_norm_still_is():
    m = zoo_designs.DistanceBiasBlock(32, 4).eval()
    assert trace(m, m, torch.randn(2, 12, 32), 32).unnormed_ffn == ()

    class NoFFNNorm(zoo_designs.DistanceBiasBlock):
        def forward(self, x):
            x = x + self.attention(self.attn_norm(x))
            return x + self.ffn(x)

    m = NoFFNNorm(32, 4).eval()
    assert set(trace(m, m, torch.randn(2, 12, 32), 32).unnormed_ffn) == {"w1", "w3"}


def test_memory_keys_and_values_count_as_attention():
    m = zoo_designs.MemoryKVBlock(32, 4).eval()
    roles = {u.name: u.role for u in trace(m, m, torch.randn(2, 12, 32), 32).modules}
    assert roles["attn.mem_k"] == roles["attn.mem_v"] == "attn.inner", roles
    assert roles["attn.to_q"] == "attn.q" and roles["w2"] == "ffn.out", roles


def test_hyper_connections_mix_streams_not_tokens():
    """Products of two activations over the streams axis are no attention: the attention check reads the one real
    call, and the norms each branch reads are found (before: two weight products read as attention without softmax,
    and norm_placement warned)."""
    by = run("HyperConnectionsBlock", only=("attention", "norm_placement", "residual", "grad_params", "batch", "causal"))
    assert by["attention"].status == Status.PASS and len(by["attention"].facts["calls"]) == 1, by["attention"].facts
    assert not [c for c in by.values() if c.status in BAD], [(c.name, c.detail) for c in by.values() if c.status in BAD]


def test_linear_attention_is_no_forgotten_softmax_while_raw_scores_still_are():
    by = run("LinearAttentionBlock", only=("attention",), causal=False)
    assert by["attention"].status == Status.SKIP, by["attention"]

    class RawScores(zoo_designs.LinearAttention):  # the token x token scores weight the values with no softmax
        def forward(self, h):
            q, k, v = (zoo_designs.heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
            return self.to_out(zoo_designs.merge((q @ k.transpose(-2, -1)) * self.scale @ v))

    class RawBlock(zoo_designs.ModuleAttentionBlock):
        attention_class = RawScores

    report = check(RawBlock(32, 4, causal=False), only=["attention"], d_model=32, n_heads=4, threads=1)
    (c,) = report.checks
    assert c.status == Status.WARN and c.kind == "attention.no_softmax", c


def test_sigmoid_weights_are_told_from_a_softmax_gone_wrong():
    """sigmoid_of: a sigmoid of an affine map of q.k per head is sigmoid attention; weights in [0, 1] that are an
    exp(s - max) without its division, or a softmax over the queries, are not."""
    from tblock_cli.anatomy.attention import sigmoid_of

    torch.manual_seed(0)
    s = torch.randn(2, 4, 10, 10) * 0.3
    assert sigmoid_of(torch.sigmoid(2.0 * s - math.log(10)), s)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    assert sigmoid_of(torch.sigmoid(s).masked_fill(~causal, 0.0), s)  # the future's weights zeroed
    assert not sigmoid_of((s - s.amax(-1, keepdim=True)).exp(), s)
    e = s.exp()
    assert not sigmoid_of(e / e.sum(-2, keepdim=True), s)
    assert not sigmoid_of(s, s)  # raw scores: negative entries


def test_square_weights_over_windows_stay_attention():
    """Weights over no token axis are dropped only where they are not square (a mix of streams) or sum over the tokens
    (linear attention's k^T v): a softmax written out over windows of 5 of the 10 tokens is still an attention call."""

    class Windowed(zoo_designs.LinearAttention):
        def forward(self, h):
            q, k, v = (zoo_designs.heads(p(h), self.n_heads) for p in (self.to_q, self.to_k, self.to_v))
            B, H, T, E = q.shape
            q, k, v = (t.reshape(B, H, T // 5, 5, E) for t in (q, k, v))
            s = (q @ k.transpose(-2, -1)) * self.scale
            e = (s - s.amax(-1, keepdim=True)).exp()
            return self.to_out(zoo_designs.merge(((e / e.sum(-1, keepdim=True)) @ v).reshape(B, H, T, E)))

    class WindowedBlock(zoo_designs.ModuleAttentionBlock):
        attention_class = Windowed

    (c,) = check(WindowedBlock(32, 4, causal=False), only=["attention"], d_model=32, n_heads=4, threads=1).checks
    assert c.status == Status.PASS and len(c.facts["calls"]) == 1 and c.facts["calls"][0]["kind"] == "weights written out", c


def test_keys_and_values_over_a_constant_read_no_stream_but_over_the_raw_stream_they_do():
    """Cross-attention over a learned context has no norm to miss; the same projections fed the raw stream (the norm
    applied to the queries only) still read as split_kv, and an FFN over a constant is no unnormed FFN."""

    class RawCross(zoo_designs.CrossAttentionBlock):
        def __init__(self, d_model=32, n_heads=4):
            super().__init__(d_model, n_heads)
            self.cross_k, self.cross_v = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(2))

        def forward(self, x):
            q = zoo_designs.heads(self.cross_q(self.cross_norm(x)), self.n_heads)
            k, v = (zoo_designs.heads(p(x), self.n_heads) for p in (self.cross_k, self.cross_v))
            return x + self.cross_o(zoo_designs.merge(F.scaled_dot_product_attention(q, k, v)))

    x = torch.randn(2, 10, 32)
    for m, split in ((zoo_designs.CrossAttentionBlock(32, 4).eval(), ()), (RawCross().eval(), ("cross_k", "cross_v"))):
        flow = trace(m, m, x, 32)
        assert flow.split_kv == split and not flow.unnormed_ffn and not flow.unnormed_attention
    flow = trace(m := zoo_designs.ClassConditionedBlock(32, 4).eval(), m, x, 32)
    assert not flow.unnormed_ffn and not flow.split_kv


def test_a_condition_replaced_by_a_learned_value_is_no_dropout_mask_but_a_zeroing_mask_is():
    from tblock_cli.checks.draws import replaced_by_constant as _replaced

    ref = torch.randn(8, 16) + 3
    null = torch.randn(16)
    gen = torch.Generator().manual_seed(0)
    keep = [torch.rand(8, 1, generator=gen) >= 0.1 for _ in range(64)]
    assert _replaced(torch.stack([torch.where(k, ref, null) for k in keep]), ref)  # classifier-free guidance
    assert not _replaced(torch.stack([ref * k for k in keep]), ref)  # rows dropped to zero, kept ones not rescaled
    assert not _replaced(torch.stack([ref * k / 0.9 for k in keep]), ref)  # inverted dropout of whole rows
    elem = [torch.rand(8, 16, generator=gen) >= 0.1 for _ in range(64)]
    assert not _replaced(torch.stack([torch.where(k, ref, null) for k in elem]), ref)  # per element: no row is null
    seq = torch.randn(8, 5, 16)  # a caption swapped for a learned null sequence (PixArt's)
    null_seq = torch.randn(5, 16)
    assert _replaced(torch.stack([torch.where(k[:, :, None], seq, null_seq) for k in keep]), seq)


def test_scores_that_vary_with_position_excuse_order_only_with_the_structure_of_positions():
    """Rotary tables computed in the forward (scores of identical tokens a function of i - j) skip `order`; heads
    split without their transpose also make identical tokens' scores vary, with no i - j structure: still warned."""
    from zoo_mixing import HeadsNoTranspose
    from zoo_training import merge

    class SplitNoTranspose(HeadsNoTranspose):
        def forward(self, x):
            B, T, C = x.shape
            h = self.n1(x)
            q, k, v = (p(h).reshape(B, self.n, T, C // self.n) for p in (self.w_a, self.w_b, self.w_c))
            x = x + self.w_d(merge(F.scaled_dot_product_attention(q, k, v)))
            return x + self.g(F.gelu(self.f(self.n2(x))))

    flags = {"d_model": 32, "n_heads": 4, "threads": 1, "only": "order"}
    (bug,) = check(lambda: SplitNoTranspose(32, 4), **flags).checks
    assert bug.status is Status.WARN and bug.kind == "order.scrambled", (bug.kind, bug.detail)
    (ok,) = check(f"{TESTS / 'zoo_designs.py'}:TablesInForwardBlock", **flags).checks
    assert ok.kind == "order.positional" and ok.facts["scores"], (ok.kind, ok.detail)


def test_a_scramble_before_a_second_attention_still_warns_and_masks_and_views_are_still_followed():
    """What the excuses of this file must not excuse: heads merged without their transpose before a second
    self-attention (its q and k then read rows no longer identical: not positions), a row mask without its rescale
    before a biased projection (dropped rows become the bias: one value, but no learned null), and a stream read
    through a view written in place (still the stream: its FFN unnormed)."""
    from zoo_training import RMSNorm, TrainBlock, heads, merge

    class TwoAttnMergeBug(TrainBlock):
        def __init__(self, d_model=32, n_heads=4):
            super().__init__(d_model, n_heads, 0.0, causal=False)
            del self.rotary
            self.norm2 = RMSNorm(d_model)
            self.q2, self.k2, self.v2, self.o2 = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

        def attn(self, h, projections, bug):
            q, k, v = (heads(p(h), self.n_heads) for p in projections[:3])
            y = F.scaled_dot_product_attention(q, k, v)
            return projections[3](y.reshape(h.shape) if bug else merge(y))

        def forward(self, x):
            x = x + self.attn(self.attn_norm(x), (self.q_proj, self.k_proj, self.v_proj, self.o_proj), True)
            x = x + self.attn(self.norm2(x), (self.q2, self.k2, self.v2, self.o2), False)
            return x + self.ffn(self.ffn_norm(x))

    (order,) = check(lambda: TwoAttnMergeBug(), d_model=32, n_heads=4, threads=1, only="order").checks
    assert order.kind == "order.scrambled", (order.kind, order.detail)

    class RowDropUnscaled(TrainBlock):
        def __init__(self, d_model=32, n_heads=4, dropout=0.1, causal=True):
            super().__init__(d_model, n_heads, dropout, causal)
            self.fc1, self.fc2 = torch.nn.Linear(d_model, 4 * d_model), torch.nn.Linear(4 * d_model, d_model)

        def ffn(self, h):
            h = F.gelu(self.fc1(h))
            if self.training:  # whole token rows dropped, the kept ones not rescaled: the bug
                h = h * (torch.rand(h.shape[:-1] + (1,), device=h.device) >= self.p).to(h.dtype)
            return self.fc2(h)

    (drop,) = check(lambda: RowDropUnscaled(), d_model=32, n_heads=4, threads=1, only="dropout").checks
    assert drop.kind == "dropout.biased", (drop.kind, drop.detail)

    class SliceAdd(TrainBlock):
        def forward(self, x):
            x = x + self.drop(self.attention(self.attn_norm(x)))
            buf = torch.zeros(x.shape)
            buf[:, :].add_(x)  # the stream written into a view: buf holds it
            return x + self.ffn(buf)

    m = SliceAdd(32, 4).eval()
    assert trace(m, m, torch.randn(2, 10, 32), 32).unnormed_ffn == ("w1", "w3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_complex_rotary_buffer_survives_the_cast_and_the_battery(dtype):
    """torchtitan's Llama keeps its rotary table as a complex buffer: Module.to(float32) would keep only its cosines
    (the scores then not a function of i - j); tblock's casts leave it complex, and the block is clean."""
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, CPU, dtype, f"{TESTS / 'zoo_complex.py'}:ComplexRotaryBlock")
    assert subject.module.freqs_cis.is_complex()
    report = run_checks(subject, cfg, CPU, dtype)
    assert not [c for c in report.checks if c.status in BAD], [(c.name, c.detail) for c in report.checks if c.status in BAD]
    bug = check(f"{TESTS / 'zoo_complex.py'}:ComplexRotaryThetaDefaulted", d_model=32, n_heads=4, causal=True, threads=1,
                only="spec").checks[0]
    assert bug.status == Status.FAIL and bug.facts["differs"][0]["key"] == "rope.theta"


def test_cast_keeps_complex_tensors_complex_where_module_to_drops_their_imaginary_part():
    from tblock_cli.probes import cast

    m = torch.nn.Module()
    m.register_buffer("table", torch.polar(torch.ones(3), torch.tensor([0.0, 1.0, 2.0])))
    m.weight = torch.nn.Parameter(torch.ones(2))
    kept = cast(m, torch.float64)
    assert kept.table.dtype == torch.complex128 and kept.weight.dtype == torch.float64
    assert torch.allclose(kept.table.imag, torch.sin(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)), atol=1e-7)
    assert cast(m, torch.bfloat16).table.dtype == torch.complex128  # no half-precision complex: kept as it was
    with pytest.warns(UserWarning, match="imaginary"):
        assert not torch.nn.Module.to(m, torch.float32).table.is_complex()  # what tblock avoids


def test_a_plain_table_that_follows_the_input_device_is_not_warned_and_one_left_behind_is():
    """Checked by moving a copy to the meta device: Meta's `self.freqs_cis.to(x.device)` runs there, a table left
    where it was built mixes devices."""
    def state_dict_of(name):
        return check(f"{TESTS / 'zoo_complex.py'}:{name}", d_model=32, n_heads=4, causal=True, threads=1,
                     only="state_dict").checks[0]

    followed, left = state_dict_of("PlainTableFollowed"), state_dict_of("PlainTableLeft")
    assert followed.kind == "state_dict.round_trip" and followed.facts["plain_tensors"] == ["PlainTableFollowed.freqs_cis"]
    assert left.kind == "state_dict.plain_tensors" and left.status == Status.WARN
    # torch.autocast("meta") raises: the block's own autocast (OLMo's) is entered as the CPU's while the copy runs there
    assert state_dict_of("PlainTableUnderAutocast").kind == "state_dict.round_trip"
