"""Roles from the dataflow: group totals to the parameter, FFN share and FLOPs on blocks of every layout."""

import pytest
import torch

import tblock_cli
from tblock_cli.anatomy import trace
from tblock_cli.anatomy.norms import find_norms
from tblock_cli.checks import Status

import zoo
from conftest import zoo_spec

D, H, T, B = 64, 4, 10, 2


def expected(name):
    """(attention, ffn, norm) parameters, derived here from each block's definition."""
    d, f = D, 4 * D
    lin = lambda i, o, bias=True: i * o + (o if bias else 0)  # noqa: E731
    ln = 2 * d
    standard = (4 * lin(d, d), lin(d, f) + lin(f, d), 2 * ln)
    hidden = int(8 * d / 3)
    return {
        "builtin": standard, "TorchPreLN": standard, "OpaqueNames": standard, "HandSoftmax": standard,
        "HandSoftmaxPrescaled": standard, "GPT2Style": standard,
        "XEncoder": (3 * lin(d, d, False) + lin(d, d), lin(d, f) + lin(f, d), 3 * ln),
        "LlamaBlock": (4 * lin(d, d, False), 3 * lin(d, hidden, False), 2 * d),
    }[name]


def matrix_params(name):
    """Weight-matrix parameters only: attention 4 d^2; FFN 2 d (4d), or 3 d hidden for SwiGLU."""
    return 4 * D * D + (3 * D * int(8 * D / 3) if name == "LlamaBlock" else 2 * D * 4 * D)


ATTENTION_FLOPS_PER_TOKEN = 4 * T * D  # scores and weighted sum: 2 T d_head per head each, over H heads


@pytest.mark.parametrize("name", ["builtin", "TorchPreLN", "OpaqueNames", "HandSoftmax", "HandSoftmaxPrescaled", "XEncoder",
                                  "LlamaBlock", "GPT2Style"])
def test_group_totals_share_and_flops_are_exact(name):
    block = None if name == "builtin" else zoo_spec(name)
    flags = {"causal": True} if name in ("LlamaBlock", "GPT2Style") else {}
    r = tblock_cli.params(block, d_model=D, n_heads=H, batch=B, seq=T, dropout=0.0, **flags)
    attention, ffn, norm = expected(name)
    assert (r.groups["attention"], r.groups["ffn"], r.groups["norm"], r.groups["other"]) == (attention, ffn, norm, 0)
    assert r.ffn_share == pytest.approx(ffn / (attention + ffn + norm), abs=0 if name != "builtin" else 1e-12)
    # forward FLOPs per token = 2 x matrix parameters + the attention terms (exact here; the issue asks 1 %)
    assert r.flops["forward"] == B * T * (2 * matrix_params(name) + ATTENTION_FLOPS_PER_TOKEN)


def test_roles_on_opaque_names_and_gates():
    block = zoo.OpaqueNames(D, H)
    flow = trace(block, block, torch.randn(B, T, D), D)
    assert {m.name: m.role for m in flow.modules} == {"n1": "norm", "n2": "norm", "w_a": "attn.q", "w_b": "attn.k", "w_c": "attn.v",
                                                      "w_d": "attn.out", "f": "ffn.in", "g": "ffn.out"}
    llama = zoo.LlamaBlock(D, H)
    roles = {m.name: m.role for m in trace(llama, llama, torch.randn(B, T, D), D).modules}
    assert (roles["gate"], roles["up"], roles["down"]) == ("ffn.gate", "ffn.in", "ffn.out")


def test_norms_are_found_by_what_they_do():
    class Scaler(torch.nn.Module):  # one per-feature parameter, but not a norm: output scales with input
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * self.g

    m = torch.nn.ModuleDict({"rms": zoo.RMSNorm(D), "ln": torch.nn.LayerNorm(D), "scale": Scaler()})
    assert find_norms(m, D, torch.device("cpu"), torch.float32) == {"rms": D, "ln": D}
    per_head = torch.nn.ModuleDict({"q_norm": zoo.RMSNorm(D // H)})
    assert find_norms(per_head, D, torch.device("cpu"), torch.float32) == {"q_norm": D // H}


@pytest.mark.parametrize("name", ["LinearFFN", "LinearFFNOpaque"])
def test_linear_ffn_is_named_and_fails_strict(name):
    r = tblock_cli.check(zoo_spec(name), d_model=D, n_heads=H, strict=True)
    by = {c.name: c for c in r.checks}
    assert by["ffn_share"].status == Status.WARN and "compose to one linear map" in by["ffn_share"].detail and not r.ok
    p = tblock_cli.params(zoo_spec(name), d_model=D, n_heads=H)
    assert len(p.linear_chains) == 1


def test_row_ranges_of_one_matrix_are_projections_of_their_own():
    """modded-nanogpt's one qkvo matrix: W[:3d] (scaled by a learned scalar) is q, k and v, W[3d:] the output; an FFN
    matrix chunked in two is its in and out. Group totals and FLOPs derived here from the definition."""
    block = zoo.SlicedQKVO(D, H, 4 * D)
    r = tblock_cli.params(block, d_model=D, n_heads=H, batch=B, seq=T, causal=True)
    attention, ffn = 4 * D * D, 2 * 4 * D * D  # the learned scalar is a parameter of its own: other
    assert (r.groups["attention"], r.groups["ffn"], r.groups["norm"], r.groups["other"]) == (attention, ffn, 0, 1)
    assert r.flops["forward"] == B * T * (2 * (4 * D * D + 8 * D * D) + ATTENTION_FLOPS_PER_TOKEN)
    roles = {m.name: m.role for m in traced_modules(block)}
    assert roles == {"qkvo_w[0:192]": "attn.qkv", "qkvo_w[192:256]": "attn.out", "lam": "other",
                     "mlp_w[0:256]": "ffn.in", "mlp_w[256:512]": "ffn.out"}, roles


def test_weights_concatenated_on_the_fly_are_each_a_projection():
    """F.linear(x, torch.cat([wq, wkv])) projects by wq and by wkv; x @ torch.cat((a, b)).T likewise. Roles, group
    totals and FLOPs derived here from the definition (they were `other` with 0 FLOPs, and ffn_share warned)."""
    block = zoo.ConcatenatedQKV(D, H, 4 * D)
    r = tblock_cli.params(block, d_model=D, n_heads=H, batch=B, seq=T, causal=True)
    assert (r.groups["attention"], r.groups["ffn"], r.groups["norm"], r.groups["other"]) == (4 * D * D, 8 * D * D, 0, 0)
    assert r.flops["forward"] == B * T * (2 * (4 * D * D + 8 * D * D) + ATTENTION_FLOPS_PER_TOKEN)
    roles = {m.name: m.role for m in traced_modules(block)}
    assert roles == {"wq": "attn.qkv", "wkv": "attn.qkv", "o": "attn.out", "up_a": "ffn.in", "up_b": "ffn.in",
                     "down": "ffn.out"}, roles
    c = tblock_cli.check(block, d_model=D, n_heads=H, causal=True, only=["ffn_share"])
    assert c.checks[0].status == Status.PASS, c.checks[0]


def test_a_key_projection_also_called_on_learned_memory_still_reads_the_normalised_stream():
    """The key and value projections read the normalised stream and, a second time, learned memory slots (constants):
    the second call replaced what the first had found, and norm_placement warned of keys reading the raw stream."""
    import zoo_layouts

    torch.manual_seed(0)
    block = zoo_layouts.ProjectedMemory(D, H)
    flow = trace(block, block, torch.randn(B, T, D), D)
    assert flow.split_kv == () and flow.unnormed_attention == (), (flow.split_kv, flow.unnormed_attention)
    c = tblock_cli.check(block, d_model=D, n_heads=H, causal=True, only=["norm_placement"])
    assert c.checks[0].status == Status.PASS, c.checks[0]


def traced_modules(block):
    torch.manual_seed(0)
    return trace(block, block, torch.randn(B, T, D), D).modules


def test_attention_whose_matrices_are_not_recognised_is_said_not_raised():
    """An attention call seen while none of its projections is recognised (their matrices 0): the FFN share's messages
    say so; they formatted the missing ratio before, a traceback in place of the report."""
    from tblock_cli.messages import text
    from tblock_cli.params_report import ffn_share_finding

    facts = {"share": 0.5, "predicted": 1.0, "matrix_ratio": None, "other": 0.33}
    for kind in ("ffn_share.measured", "ffn_share.other"):
        assert "no weight matrix of attention's found" in text(kind, facts)
    _, finding = ffn_share_finding({"ffn": 2, "attention": 0}, {"ffn": 2, "attention": 0}, 3, None)
    assert finding.facts["matrix_ratio"] is None and finding.facts["no_attention_matrix"]
    assert "no weight matrix of attention's found" in text(finding.kind, finding.facts)


def test_no_attention_means_no_share():
    class MLPOnly(torch.nn.Module):
        def __init__(self, d_model=D):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d_model, 4 * d_model), torch.nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    r = tblock_cli.params(MLPOnly(), d_model=D)
    assert r.ffn_share is None and "no attention" in r.ffn_note
    c = {x.name: x for x in tblock_cli.check(MLPOnly(), d_model=D).checks}
    assert c["ffn_share"].status == Status.SKIP and c["attention"].status == Status.SKIP


def test_a_tracing_slip_is_counted_and_reported_not_a_block_without_attention(monkeypatch):
    """A recorder that raises never breaks the forward; it is counted, and attention says why it saw no attention."""
    from tblock_cli.anatomy.tracer import Tracer

    real = Tracer.record

    def slips_on_softmax(self, func, name, args, kwargs, out):
        if name == "softmax":
            raise RuntimeError("planted slip")
        return real(self, func, name, args, kwargs, out)

    monkeypatch.setattr(Tracer, "record", slips_on_softmax)
    r = tblock_cli.check(zoo_spec("HandSoftmax"), d_model=32, n_heads=4, threads=1, only=["attention"])
    (attention,) = r.checks
    assert attention.status == Status.SKIP and attention.kind == "attention.none"
    assert attention.facts["tracing_slips"] >= 1 and "planted slip" in attention.facts["slip_errors"][0]
    assert "could not record" in attention.text


class AtNamed(torch.nn.Module):
    """A block held under a name that starts with '@': every projection's name does too."""

    def __init__(self, inner):
        super().__init__()
        self.add_module("@block", inner)

    def forward(self, x, pad_mask=None):
        return getattr(self, "@block")(x)


def test_module_names_never_read_as_provenance_markers():
    """Markers (a norm's restart, attention's steps) are their own type, so no module name can pass for one: a block
    whose every name starts with '@' gets the roles the same block gets under its own names."""
    torch.manual_seed(0)
    for inner in (zoo.OpaqueNames(D, H), zoo.LlamaBlock(D, H)):
        x = torch.randn(B, T, D)
        plain = {m.name: m.role for m in trace(inner, inner, x, D).modules}
        block = AtNamed(inner)
        named = {m.name: m.role for m in trace(block, block, x, D).modules}
        assert named == {f"@block.{n}": r for n, r in plain.items()}
        assert "attn.q" in plain.values() and "ffn.out" in plain.values()


def test_the_scale_note_is_data_and_its_sentence_is_the_one_the_check_always_wrote():
    from tblock_cli.anatomy.attention import ScaleNote

    assert ScaleNote("qk", 0.25, sdpa=True, passed=None).text == (
        "the q and k that reach the product (a factor 0.25 folded into them); scale 1/sqrt(E) by default")
    assert ScaleNote("qk", sdpa=True, passed=0.125).text == "the q and k that reach the product; scale 0.125 passed"
    assert ScaleNote("mha").text == "scale 1/sqrt(d_head), built into nn.MultiheadAttention"
    x = torch.randn(B, T, D)
    block = zoo.LlamaBlock(D, H)
    (call,) = trace(block, block, x, D).attention
    assert call.scale_note.kind == "qk" and isinstance(call.scale_note.folded, float)


def test_reweighting_reads_a_second_softmax_and_not_a_renormalised_subset_or_a_mix_of_heads():
    """std of log w over std of log p, each row-centred: a softmax of the probabilities flattens them (log w = p + c,
    whose spread is the probabilities', ~1/keys of the logits'); a renormalised top-k keeps every log-difference (1);
    weights that are p, or that mix heads (no longer in p's order within a row), are not read."""
    from tblock_cli.anatomy.attention import reweighting

    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 4, 10, 10, generator=g, dtype=torch.float64)
    p = s.softmax(-1)
    twice = reweighting(p.softmax(-1), p)
    expected = ((p - p.mean(-1, keepdim=True)).norm() / (p.log() - p.log().mean(-1, keepdim=True)).norm()).item()
    assert twice == pytest.approx(expected, rel=1e-9) and twice < 0.2
    top = p.topk(4, dim=-1)
    kept = torch.zeros_like(p).scatter(-1, top.indices, top.values)
    assert reweighting(kept / kept.sum(-1, keepdim=True), p) == pytest.approx(1.0, abs=1e-9)
    assert reweighting(p.clone(), p) is None
    mix = torch.full((4, 4), 0.2, dtype=torch.float64) + 0.2 * torch.eye(4, dtype=torch.float64)  # rows sum to 1
    assert reweighting(torch.einsum("hg,bgij->bhij", mix, p), p) is None  # talking heads after the softmax


def test_an_einsum_of_two_tables_is_no_attention_and_q_k_is_read_through_the_tables_it_made():
    """torchscale's XPos builds its angles as einsum('i , j -> i j', positions, frequencies) in the forward: a product
    of two tensors that depend on no token. Read as a score product, the rotated q and k carried it, and q.k was taken
    for weights times values (no softmax, k a value projection)."""
    import zoo_xpos

    block = zoo_xpos.XPosBlock(D, H).eval()
    (call,) = trace(block, block, torch.randn(B, T, D), D).attention
    assert (call.kind, call.head_dim, call.q, call.k, call.v) == ("softmax(QK^T)V", D // H, ("q_proj",), ("k_proj",),
                                                                 ("v_proj",))
    r = tblock_cli.check(str(zoo_spec("XPosBlock")).replace("zoo.py:", "zoo_xpos.py:"), d_model=32, n_heads=4,
                         causal=True, threads=1, only="attention,names,relative")
    by = {c.name: c for c in r.checks}
    assert {n: c.status for n, c in by.items()} == dict.fromkeys(("attention", "names", "relative"), Status.PASS), by
    assert by["relative"].kind == "relative.toeplitz"  # its scores read (every tracer follows the input): judged
