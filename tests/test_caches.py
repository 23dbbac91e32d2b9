"""subject/caches.py: each library's cache convention recognised and driven, against the model's own full forward."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch
from blocks_models import GPT, GPTConfig, Llama, LlamaArgs, ModelArgs, Transformer
from blocks_models_tuned import Config, LitGPT, tiny_decoder

from tblock_cli.subject import caches
from tblock_cli.subject.portable import on_this_machine

TOL = 1e-10  # float64: decoding reorders nothing but the softmax's length, so only rounding differs
TOL_F32 = 1e-4  # the real libraries compute their rotary tables in float32 whatever the model's dtype
# A folder holding clones of gpt-fast and Meta's llama (not on PyPI): their tests run where it is set, skip elsewhere.
SOURCES = os.environ.get("TBLOCK_MODEL_SOURCES")
EXT = Path(SOURCES) if SOURCES else None


def gpt_fast(n_local_heads=2):
    return Transformer(ModelArgs(n_local_heads=n_local_heads))


def meta(n_kv_heads=2):
    with on_this_machine():  # its caches are made with .cuda() in __init__
        return Llama(LlamaArgs(n_kv_heads=n_kv_heads))


BUILDERS = {"gpt-fast": (gpt_fast, caches.GPT_FAST), "meta": (meta, caches.META),
            "litgpt": (lambda: LitGPT(Config()), caches.LITGPT), "torchtune": (tiny_decoder, caches.TORCHTUNE)}


def load_file(path: Path | None, name: str):
    if path is None:
        pytest.skip("TBLOCK_MODEL_SOURCES names no folder of model sources")
    if not path.exists():
        pytest.skip(f"{path} is not here")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The real libraries, where installed or cloned (the suite passes without them): the same sizes, two kv heads.
def real_litgpt():
    lit = pytest.importorskip("litgpt.model", exc_type=ImportError)
    return lit.GPT(lit.Config(n_layer=2, n_head=4, n_query_groups=2, n_embd=32, block_size=32, vocab_size=64,
                              padded_vocab_size=64, intermediate_size=64, mlp_class_name="LLaMAMLP",
                              norm_class_name="RMSNorm", parallel_residual=False, bias=False, rotary_percentage=1.0))


def real_torchtune():
    llama3 = pytest.importorskip("torchtune.models.llama3", exc_type=ImportError)
    return llama3.llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=32,
                         intermediate_dim=64)


def real_gpt_fast():
    fast = load_file(EXT and EXT / "gpt-fast" / "model.py", "gpt_fast_model")
    if "mask" in inspect.signature(fast.Transformer.forward).parameters:  # newer gpt-fast: flex attention's BlockMask
        pytest.skip("gpt-fast's newer model.py takes a flex-attention BlockMask before the ids: not a convention tblock drives")
    return fast.Transformer(fast.ModelArgs(block_size=32, vocab_size=64, n_layer=2, n_head=4, dim=32,
                                           intermediate_size=64, n_local_heads=2))


def real_meta():
    pytest.importorskip("fairscale", exc_type=ImportError)
    llama = load_file(EXT and EXT / "llama" / "llama" / "model.py", "meta_llama_model")
    assert caches.model_parallel_world(llama.Transformer) is True
    assert caches.model_parallel_world(llama) is True  # a second call finds the world there
    with on_this_machine():
        model = llama.Transformer(llama.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                                  multiple_of=16, max_batch_size=4, max_seq_len=32))
    for p in model.parameters():  # fairscale's parallel layers are built with init_method=lambda x: x: left empty
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.1)
    return model


REAL = {"real-litgpt": (real_litgpt, caches.LITGPT), "real-torchtune": (real_torchtune, caches.TORCHTUNE),
        "real-gpt-fast": (real_gpt_fast, caches.GPT_FAST), "real-meta": (real_meta, caches.META)}
EVERY = {**BUILDERS, **REAL}
pytestmark = pytest.mark.usefixtures("torn_down_world")


def cases(names) -> list:
    """The real libraries' cases run with the slow tests (importing litgpt alone takes seconds), in CI too."""
    return [pytest.param(n, marks=pytest.mark.slow) if n.startswith("real-") else n for n in names]


def build(name, dtype=torch.float64, seed=0):
    """The model, in float64 (the real libraries in float32: they compute rotary tables in float32 anyway)."""
    torch.manual_seed(seed)
    return EVERY[name][0]().to(dtype if name in BUILDERS else torch.float32).eval()


def tol(name):
    return TOL if name in BUILDERS else TOL_F32



def logits(out):
    return out[0] if isinstance(out, tuple) else out


def decode(model, conv, ids, sizes, fresh=True):
    """ids (B, T) fed chunk by chunk through the convention; the logits of every position."""
    B, T = ids.shape
    if fresh:
        conv.prepare(model, B, T)
    outs, start = [], 0
    for n in sizes:
        outs.append(logits(model(ids[:, start:start + n], **conv.forward_kwargs(model, start, n, B, ids.device))))
        start += n
    return torch.cat(outs, dim=1)


def full(model, conv, ids):
    """The whole sequence in one call: the model's plain forward where it has one, else one chunk from position 0."""
    if conv.always:
        return decode(model, conv, ids, [ids.shape[1]])
    conv.release(model)
    return logits(model(ids))


def close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol * (1 + b.abs().max().item())


@pytest.mark.parametrize("name", cases(EVERY))
def test_recognise_reads_what_the_model_has(name):
    assert caches.recognise(build(name)) is EVERY[name][1]


def test_recognise_finds_no_cache_in_a_nanogpt_style_model():
    assert caches.recognise(GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32))) is None  # nanoGPT style: no cache of its own


@pytest.mark.parametrize("name", cases(EVERY))
def test_token_by_token_equals_the_full_forward(name):
    model, conv = build(name), EVERY[name][1]
    ids = torch.randint(0, 64, (2, 12))
    want = full(model, conv, ids)
    got = decode(model, conv, ids, [5] + [1] * 7)
    assert got.shape == want.shape == (2, 12, 64)
    assert close(got, want, tol(name))
    assert close(decode(model, conv, ids, [3, 4, 5]), want, tol(name))  # chunks of several tokens after the prompt


@pytest.mark.parametrize("name", cases(EVERY))
def test_snapshots_let_two_sequences_decode_in_turns(name):
    model, conv = build(name), EVERY[name][1]
    a, b = torch.randint(0, 64, (2, 10)), torch.randint(0, 64, (2, 10))
    want_a, want_b = full(model, conv, a), full(model, conv, b)
    conv.prepare(model, 2, 10)
    saved = {"a": caches.snapshot(model, conv), "b": caches.snapshot(model, conv)}
    outs: dict = {"a": [], "b": []}
    for start, n in [(0, 4), (4, 3), (7, 3)]:
        for key, ids in (("a", a), ("b", b)):
            caches.restore(model, conv, saved[key])
            outs[key].append(decode(model, conv, ids[:, start:start + n], [n], fresh=False) if start == 0 else
                             logits(model(ids[:, start:start + n], **conv.forward_kwargs(model, start, n, 2, "cpu"))))
            saved[key] = caches.snapshot(model, conv)
    assert close(torch.cat(outs["a"], 1), want_a, tol(name)) and close(torch.cat(outs["b"], 1), want_b, tol(name))


@pytest.mark.parametrize("name", cases(["gpt-fast", "litgpt", "meta", "real-gpt-fast", "real-litgpt"]))
def test_without_a_restore_the_other_sequence_shows(name):
    """The planted fault the snapshots prevent: caches written at positions keep the last sequence's keys."""
    model, conv = build(name), EVERY[name][1]
    a, b = torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))
    want_a = full(model, conv, a)
    conv.prepare(model, 1, 8)
    decode(model, conv, a[:, :4], [4], fresh=False)
    decode(model, conv, b[:, :4], [4], fresh=False)
    tail = logits(model(a[:, 4:], **conv.forward_kwargs(model, 4, 4, 1, "cpu")))
    assert not close(tail, want_a[:, 4:], 1e-3)


def kv_per_position(model, name):
    """Bytes per sequence and position, read off the model's own cache attributes (not through caches.tensors)."""
    name = name.removeprefix("real-")
    if name == "meta":
        attns = [layer.attention for layer in model.layers]
        return sum(t.numel() * t.element_size() // (t.shape[0] * t.shape[1]) for a in attns
                   for t in (a.cache_k, a.cache_v))
    attns = [layer.attention if name == "gpt-fast" else layer.attn for layer in
             (model.transformer.h if name == "litgpt" else model.layers)]
    pairs = [(a.kv_cache.k, a.kv_cache.v) if name == "litgpt" else (a.kv_cache.k_cache, a.kv_cache.v_cache)
             for a in attns]
    return sum(t.numel() * t.element_size() // (t.shape[0] * t.shape[2]) for pair in pairs for t in pair)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_held_bytes_count_the_kv_heads_the_cache_stores(name, kv_heads):
    torch.manual_seed(0)
    model = {"gpt-fast": lambda: gpt_fast(kv_heads), "meta": lambda: meta(kv_heads),
             "litgpt": lambda: LitGPT(Config(n_query_groups=kv_heads)),
             "torchtune": lambda: tiny_decoder(num_kv_heads=kv_heads)}[name]().double().eval()
    conv = BUILDERS[name][1]
    decode(model, conv, torch.randint(0, 64, (3, 12)), [12])  # Meta's caches become float64 in the forward
    layers, head_dim, item, batch, positions = 2, 32 // 4, 8, 3, 10
    want = 2 * layers * batch * positions * kv_heads * head_dim * item
    assert caches.held_bytes(model, conv, positions) == want
    assert kv_per_position(model, name) * batch * positions == want


def test_a_new_batch_sets_gpt_fast_style_caches_up_again():
    model, conv = build("gpt-fast"), caches.GPT_FAST
    ids = torch.randint(0, 64, (3, 9))
    decode(model, conv, ids[:2], [9])  # caches for 2 sequences: a batch of 3 needs new ones, not the old ones
    assert close(decode(model, conv, ids, [4, 5]), full(model, conv, ids))
    assert model.layers[0].attention.kv_cache.k_cache.shape[0] == 3


def test_meta_style_caches_refuse_more_than_they_hold():
    model, conv = build("meta"), caches.META
    with pytest.raises(ValueError, match="4 sequences of 32 positions") as e:
        conv.prepare(model, 5, 8)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="32 positions"):
        conv.prepare(model, 1, 33)


@pytest.mark.parametrize("name", cases(["litgpt", "torchtune", "real-litgpt", "real-torchtune"]))
def test_release_gives_back_the_plain_forward(name):
    model, conv = build(name), EVERY[name][1]
    ids = torch.randint(0, 64, (2, 8))
    before = logits(model(ids))
    decode(model, conv, ids, [8])
    assert conv.tensors(model)
    conv.release(model)
    assert not conv.tensors(model)
    assert torch.equal(logits(model(ids)), before)


# Not torchtune's style: its caches advance their write pointer in place after indexing with it, so even one backward
# through cached attention fails there (the same in torchtune itself); it trains with its caches released.
@pytest.mark.parametrize("name", cases(["gpt-fast", "litgpt", "meta", "real-gpt-fast", "real-litgpt", "real-meta"]))
def test_detach_state_unchains_training_forwards(name):
    """A training forward writes keys into the caches in place: the next one chains onto a freed graph."""
    def step(model):
        model.train()
        ids = torch.randint(0, 64, (2, 6))
        # Meta's forward under its @torch.inference_mode(), as tblock calls it to measure gradients
        forward = getattr(type(model).forward, "__wrapped__", type(model).forward)
        logits(forward(model, ids, **conv.forward_kwargs(model, 0, 6, 2, "cpu"))).square().mean().backward()

    conv = EVERY[name][1]
    chained = build(name)
    conv.prepare(chained, 2, 8)
    step(chained)
    with pytest.raises(RuntimeError):
        step(chained)
    model = build(name)
    conv.prepare(model, 2, 8)
    step(model)
    caches.detach_state(model)
    left = [n for m in model.modules() for n, t in list(m._buffers.items()) + list(vars(m).items())
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    assert left == []
    step(model)


def test_model_parallel_world_is_a_no_op_without_fairscale():
    import torch.distributed as dist

    assert caches.model_parallel_world(Transformer) is False
    assert caches.model_parallel_world(sys.modules[Transformer.__module__]) is False
    assert not dist.is_initialized()




@pytest.mark.parametrize("name", cases(REAL))
def test_held_bytes_of_the_real_libraries(name):
    model, conv = build(name), EVERY[name][1]
    decode(model, conv, torch.randint(0, 64, (3, 12)), [12])
    want = 2 * 2 * 3 * 10 * 2 * 8 * 4  # keys and values, layers, batch, positions, kv heads, head dim, float32
    assert caches.held_bytes(model, conv, 10) == want == kv_per_position(model, name) * 3 * 10
