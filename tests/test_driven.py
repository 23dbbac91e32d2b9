"""--block MODEL_SPEC --layer N: a layer driven through its own model's forward (subject/driven.py), against the model
run as its library runs it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from blocks_models import GPT, Llama, Transformer
from blocks_models_tuned import LitGPT, ScaledModel, tiny_decoder
from typer.testing import CliRunner

from tblock_cli import api
from tblock_cli.cli import app
from tblock_cli.errors import LoadError
from tblock_cli.subject import caches
from tblock_cli.subject.setup import setup

SIZES = dict(d_model=32, n_heads=4, d_ff=64, dropout=0.0, seq=8, threads=1)
# Every style of model: the class or builder, and the kwargs that make its attention grouped-query where it can be.
MODELS = {"nanogpt": (GPT, {}), "gpt-fast": (Transformer, {"n_local_heads": 2}), "meta": (Llama, {"n_kv_heads": 2}),
          "litgpt": (LitGPT, {"n_query_groups": 2}), "torchtune": (tiny_decoder, {"num_kv_heads": 2})}
TOL = 1e-12  # float64: the same operations in the same order, only the way in differs


def built(name: str, layer: int = 0, **options):
    factory, kwargs = MODELS[name]
    s = setup(factory, {**SIZES, "dtype": "float32", "kwargs": kwargs, "layer": layer, **options})
    return s, s.make()


def own_forward(name: str, model: nn.Module, ids: torch.Tensor):
    """The model run as its library runs it for a whole sequence, in the library's own API."""
    T = ids.shape[1]
    if name == "gpt-fast":
        model.setup_caches(ids.shape[0], T)
        return model(ids, torch.arange(T))
    if name == "meta":
        return type(model).forward.__wrapped__(model, ids, 0)  # its decorator turns off autograd, not the result
    return model(ids)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_driven_layer_computes_what_the_model_computes_there(name):
    """Layer 1 of a 2-layer model: tblock's wrapper on the hidden states the model hands layer 1 gives what layer 1
    gave inside the model's own forward (masks, positions and caches as the model makes them)."""
    s, subject = built(name, layer=1)
    module = subject.module.double()
    model = module._model
    seen = {}
    layer = module._all[1]

    def enter(_m, args, _kwargs):
        seen["in"] = args[0].clone()

    def leave(_m, _args, out):
        seen["out"] = (out[0] if isinstance(out, tuple) else out).clone()

    h1, h2 = layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        own_forward(name, model, ids)
    h1.remove(), h2.remove()
    with torch.no_grad():
        ours = module(seen["in"])
    assert torch.allclose(ours, seen["out"], atol=TOL, rtol=0), (ours - seen["out"]).abs().max()
    assert module.span == (1, 1) and len(module.layers) == 1
    assert module.causal, f"{name}: every layer here is causal, and its model says so by what it computes"


@pytest.mark.parametrize("name", ["nanogpt", "gpt-fast"])
def test_only_the_layers_parameters_are_the_blocks(name):
    """The embedding, final norm and head are the model's, not the block's: the count is the layer's, by formula."""
    _, subject = built(name)
    d, f = SIZES["d_model"], SIZES["d_ff"]
    if name == "nanogpt":  # two LayerNorms, c_attn, c_proj, a 4d MLP (its width is its own code's), all with biases
        expected = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    else:  # two RMSNorms, wqkv with 2 of 4 heads for k/v, wo, a SwiGLU of the --d-ff width, no biases
        hd = d // 4
        expected = 2 * d + d * (d + 2 * 2 * hd) + d * d + 3 * d * f
    assert sum(p.numel() for p in subject.module.parameters()) == expected
    assert api.params(MODELS[name][0], **SIZES, kwargs=MODELS[name][1], layer=0).total == expected


def test_the_model_is_built_small_with_the_layers_asked_for():
    s, subject = built("gpt-fast", layer=2, layers=2)
    model = subject.module._model
    assert len(model.layers) == 4 and subject.module.span == (2, 3)  # layers 2 and 3 of a model of 4
    assert model.tok_embeddings.num_embeddings == 256  # a placeholder vocabulary, not the config's default
    assert model.config.dim == 32 and model.config.n_head == 4 and model.config.intermediate_size == 64


@pytest.mark.parametrize("name", ["gpt-fast", "meta", "litgpt", "torchtune"])
def test_kv_cache_bytes_count_the_kv_heads_the_cache_holds(name):
    """Grouped-query: 2 kv heads of 4 hold half the multi-head figure; counted from what the model's caches hold."""
    report = api.check(MODELS[name][0], only="kv_cache", **SIZES, kwargs=MODELS[name][1], layer=0)
    (result,) = report.checks
    assert result.status.value == "pass", result.detail
    kv_heads, head_dim, batch, item = 2, SIZES["d_model"] // SIZES["n_heads"], 2, 4
    per_position = 2 * kv_heads * head_dim * item  # keys and values, one layer
    assert result.facts["bytes"] == batch * result.facts["positions"] * per_position


def test_a_model_with_no_cache_convention_skips_kv_cache():
    (result,) = api.check(GPT, only="kv_cache", **SIZES, layer=0).checks
    assert result.status.value == "skip"


@pytest.mark.parametrize("name", ["meta", "gpt-fast"])
def test_gradients_reach_the_layer_through_an_inference_only_forward(name):
    """Meta's forward runs under @torch.inference_mode(), gpt-fast's only with its caches set up: the layer's
    gradients are still the layer's, twice in a row (no graph chained through the caches between calls)."""
    _, subject = built(name)
    module = subject.module.train()
    for _ in range(2):
        x = torch.randn(2, 8, 32, requires_grad=True)
        module(x).square().sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
        module.zero_grad()
    assert not [n for m in module._model.modules() for n, b in m._buffers.items() if b is not None and b.grad_fn is not None]


class Unwritten(nn.Module):
    """A model whose layers take weights nobody initialises (fairscale's identity init_method), and one written."""

    def __init__(self, n_embd: int = 32, n_layer: int = 1, vocab_size: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList(Layer(n_embd) for _ in range(n_layer))

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return x


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.raw = nn.Parameter(torch.Tensor(d, d))  # allocated, never written
        self.fc = nn.Linear(d, d)  # initialised by its own reset_parameters
        self.table = nn.Parameter(torch.from_numpy(np.linspace(0, 1, d, dtype=np.float32)), requires_grad=False)

    def forward(self, x):
        return x + torch.tanh(x @ self.raw.T) + self.fc(x) + self.table


def test_parameters_nothing_wrote_get_seeded_values_and_written_ones_stay():
    _, a = built_any(Unwritten, seed=3)
    _, b = built_any(Unwritten, seed=3)
    raw = a.module.layers[0].raw
    assert torch.isfinite(raw).all() and abs(raw.std().item() - 0.02) < 0.005
    assert torch.equal(raw, b.module.layers[0].raw)  # seeded: the same at the same --seed
    torch.manual_seed(3)
    own = Unwritten(vocab_size=256)  # tblock's placeholder vocabulary; the Linear initialised as without tblock
    assert torch.equal(a.module.layers[0].fc.weight, own.layers[0].fc.weight)
    assert torch.equal(a.module.layers[0].table, torch.from_numpy(np.linspace(0, 1, 32, dtype=np.float32)))  # kept


def built_any(factory, **options):
    s = setup(factory, {**SIZES, "layer": 0, **options})
    return s, s.make()


@pytest.mark.parametrize("args, needle", [
    (["--layer", "0"], "--layer N drives a layer of the model --block builds (hf:TYPE, "),
    (["--block", "tests/blocks_models.py:GPT", "--layer", "-1"], "--layer must be in [0,"),
])
def test_layer_mistakes_are_one_line_and_exit_2(args, needle):
    result = CliRunner().invoke(app, ["params", *args, "--d-model", "32", "--n-heads", "4"])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


class Fixed(nn.Module):
    """A model whose layer count is its own (no field for it): two layers."""

    def __init__(self, n_embd: int = 32):
        super().__init__()
        self.emb = nn.Embedding(8, n_embd)
        self.blocks = nn.Sequential(Layer(n_embd), Layer(n_embd))

    def forward(self, idx):
        return self.blocks(self.emb(idx))


def test_a_layer_past_the_models_own_count_is_refused():
    with pytest.raises(LoadError, match=r"--layer 2: the model has 2 layer\(s\) in blocks"):
        built_any(Fixed, layer=2)
    _, subject = built_any(Fixed, layer=1)
    assert subject.module.span == (1, 1)


class Early(Fixed):
    """A forward that returns before its second layer."""

    def forward(self, idx):
        return self.blocks[0](self.emb(idx))


def test_a_forward_that_never_reaches_the_layer_is_one_line():
    with pytest.raises(LoadError, match="driving the model's forward on token ids failed: .*never reached"):
        built_any(Early, layer=1)


class TwoTokensAtLeast(Fixed):
    """A model whose own plumbing refuses a one-token sequence before any layer runs (nanochat asserts T > 1)."""

    def forward(self, idx):
        assert idx.shape[1] > 1, "Training forward pass should have T > 1"
        return self.blocks(self.emb(idx))


def test_one_token_refused_by_the_model_before_its_layer_is_not_the_layers_finding():
    r = api.check(TwoTokensAtLeast, layer=0, only="shape,causal", causal=True, **SIZES)
    by = {c.name: c for c in r.checks}
    assert by["shape"].kind == "shape.kept" and by["causal"].status.value == "pass", [(c.kind, c.detail) for c in r.checks]


class OneTokenLayer(nn.Module):
    """A layer that itself fails on one token (a reduction over the empty rest of the sequence)."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(x) + 0 * x[:, 1:].max()


class OneTokenLayers(Fixed):
    def __init__(self, n_embd: int = 32):
        super().__init__(n_embd)
        self.blocks = nn.Sequential(OneTokenLayer(n_embd), OneTokenLayer(n_embd))


def test_one_token_refused_by_an_earlier_layer_is_still_the_layers_finding():
    """--layer 1: layer 0, the same code, raises first on its placeholders; that is a layer's error, not the model's."""
    (shape,) = api.check(OneTokenLayers, layer=1, only="shape", **SIZES).checks
    assert shape.kind == "shape.one_token_raises", (shape.kind, shape.detail)


def test_a_size_flag_the_model_takes_under_no_field_is_warned_only_when_it_misses():
    """nanoGPT-style: no FFN width field, 4 x n_embd by its code: --d-ff 128 at d 32 reaches it, --d-ff 80 does not."""
    assert not [w for w in setup_warnings(GPT, d_ff=128) if "--d-ff" in w]
    assert [w for w in setup_warnings(GPT, d_ff=80) if "--d-ff does not reach" in w]


def setup_warnings(factory, **options):
    s = setup(factory, {**SIZES, "layer": 0, **options})
    s.resolve()
    return s.warnings


def test_depth_drives_each_layer_through_the_model():
    report = api.depth(Transformer, **{**SIZES, "layers": 2}, layer=0)
    assert len(report.layers) == 2


def test_caches_convention_is_recognised_for_the_driven_layer():
    _, subject = built("torchtune")
    assert subject.module.convention is caches.TORCHTUNE and subject.module.decodes
    _, subject = built("nanogpt")
    assert subject.module.convention is None and not subject.module.decodes


# The full battery on every style, the libraries' own models where installed: zero false alarms. A warning is allowed
# only where it is true of that code (tensors kept as plain attributes, which .to() does not move).
LONG = {"nanogpt": {"block_size": 1024}, "gpt-fast": {"block_size": 1024}, "meta": {"max_seq_len": 1024},
        "litgpt": {"block_size": 1024}, "torchtune": {"max_seq_len": 1024}}
TRUE_OF_THE_CODE = {"state_dict.plain_tensors"}


def assert_clean(report):
    bad = [(c.name, c.status.value, c.kind, c.detail) for c in report.checks
           if c.status.value in ("fail", "error") or (c.status.value == "warn" and c.kind not in TRUE_OF_THE_CODE)]
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_the_battery_finds_nothing_false_on_a_correct_layer_of_each_style(name):
    factory, kwargs = MODELS[name]
    assert_clean(api.check(factory, **SIZES, kwargs={**kwargs, **LONG[name]}, layer=0))


@pytest.mark.slow
@pytest.mark.parametrize("spec, kwargs", [("litgpt.model:GPT", {"name": "Llama-3.2-1B"}),
                                          ("litgpt.model:GPT", {"name": "pythia-160m"}),
                                          ("torchtune.models.llama3:llama3", {})])
def test_the_libraries_own_models_check_clean_with_no_adapter(spec, kwargs):
    pytest.importorskip(spec.partition(":")[0], exc_type=ImportError)
    report = api.check(spec, d_model=64, n_heads=4, d_ff=256, threads=1, kwargs=kwargs, layer=0)
    assert_clean(report)
    assert next(c for c in report.checks if c.name == "kv_cache").status.value == "pass"


@pytest.mark.slow
def test_litgpts_llama_layer_equals_hf_llama_with_no_adapter():
    pytest.importorskip("litgpt.model", exc_type=ImportError)
    pytest.importorskip("transformers")
    report = api.compare("litgpt.model:GPT", "hf:llama", d_model=64, n_heads=4, d_ff=256, threads=1, layer=0,
                         kwargs_a='{"name": "Llama-2-7b-hf"}', kwargs_b='{"rms_norm_eps": 1e-5}')
    assert report.ok, report.to_dict()


@pytest.mark.slow
@pytest.mark.usefixtures("torn_down_world")
@pytest.mark.parametrize("path, kwargs", [("nanoGPT/model.py:GPT", {}), ("gpt-fast/model.py:Transformer", {}),
                                          ("gpt-fast/model.py:Transformer", {"n_local_heads": 2}),
                                          ("llama/llama/model.py:Transformer", {}),
                                          ("nanochat/nanochat/gpt.py:GPT", {"n_kv_head": 4})])
def test_the_repositories_own_files_check_clean_with_no_adapter(path, kwargs, monkeypatch):
    """Cloned sources (TBLOCK_MODEL_SOURCES names their folder): the model file as it is, only tblock's flags.
    nanochat's model imports its package (nanochat.common): the clone's root goes on sys.path, and its model asserts
    T > 1 before any layer (a one-token run is the model's refusal, not the layer's finding)."""
    folder = os.environ.get("TBLOCK_MODEL_SOURCES")
    if not folder or not Path(folder, path.partition(":")[0]).is_file():
        pytest.skip("TBLOCK_MODEL_SOURCES holds no clone of " + path.partition("/")[0])
    if path.startswith("llama/"):
        pytest.importorskip("fairscale", exc_type=ImportError)
    spec = str(Path(folder, path))
    if path.startswith("gpt-fast/") and "def forward(self, mask: BlockMask, idx" in Path(folder, path.partition(":")[0]).read_text():
        pytest.skip("gpt-fast's newer model.py takes a flex-attention BlockMask before the ids: not a convention tblock drives")
    if path.startswith("nanochat/"):
        monkeypatch.syspath_prepend(str(Path(folder, "nanochat")))
        spec = "nanochat.gpt:GPT"
    report = api.check(spec, d_model=64, n_heads=4, d_ff=256, threads=1, kwargs=kwargs, layer=0)
    assert_clean(report)
    if not path.startswith(("nanoGPT", "nanochat")):
        assert next(c for c in report.checks if c.name == "kv_cache").status.value == "pass"


def test_bench_decodes_through_the_models_own_cache_and_counts_its_kv_heads():
    """gpt-fast style, 2 kv heads of 4: the bytes the model's cache holds after prompt + tokens are the traced k/v
    widths' (half the multi-head figure), by formula."""
    report = api.bench(Transformer, mode="infer", min_time=0.01, decode=4, **SIZES,
                       kwargs={"n_local_heads": 2}, layer=0)
    cached = next(r for r in report.results if r.mode == "decode" and r.kv_cache)
    per_position = 2 * 2 * (SIZES["d_model"] // SIZES["n_heads"]) * 4  # k and v, 2 kv heads, float32
    assert cached.cache_bytes == 2 * (8 + 4) * per_position  # batch 2
    assert report.decode_analytic_bytes == cached.cache_bytes and report.decode_expected_from == "trace"


@pytest.mark.parametrize("block", ["hf:llama", GPT])
def test_a_later_layer_costs_what_the_first_does(block):
    """The layers before N run on the placeholders as the model's plumbing: tblock's tracer sees only layer N's work,
    so its FLOPs and parameters are layer 0's (the same widths), not those of every layer up to it."""
    if block == "hf:llama":
        pytest.importorskip("transformers")
    first, later = (api.params(block, **SIZES, layer=n) for n in (0, 2))
    assert later.total == first.total and later.flops == first.flops
    assert later.run.subject.endswith("layer 2")


def test_an_hf_models_later_layer_is_its_own_kind():
    """qwen3_next puts full attention at every 4th layer, gated delta nets elsewhere: layer 3 is the full-attention one,
    and its attention check reads that one call (the earlier layers' linear attention is not its)."""
    pytest.importorskip("transformers")
    s = setup("hf:qwen3_next", {**SIZES, "d_model": 64, "d_ff": 256, "layer": 3})
    layer = s.make().module.layers[0]
    assert type(layer.self_attn).__name__.endswith("Attention") and not hasattr(layer, "linear_attn")
    (result,) = api.check("hf:qwen3_next", only="attention", **{**SIZES, "d_model": 64, "d_ff": 256}, layer=3).checks
    assert result.status.value == "pass" and all(c["where"] != "root" for c in result.facts["calls"]), result.facts


@pytest.mark.parametrize("causal", [False, True])
def test_what_the_model_does_is_read_behind_a_small_branch_gain(causal):
    """Behind LayerScale 1e-6 a later token moves earlier outputs by ~6e-7 of the output, under the relative rounding
    room: the layers were taken for causal, and `causal` then failed the prefix of a bidirectional model
    (sam3_lite_text's RepMixer layer, LayerScale 1e-5). The change is judged against the layers' update too
    (probes.update_share)."""
    _, subject = built_any(functools.partial(ScaledModel, causal=causal))
    assert subject.module.causal is causal

