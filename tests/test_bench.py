"""bench: the memory figure against known allocations, the need_weights hook, kernel naming, CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli import runtime
from tblock_cli.benchmark import profiling
from tblock_cli.benchmark.report import BenchReport, BenchResult
from tblock_cli.benchmark.run import forced_need_weights, run_bench
from tblock_cli.benchmark.timing import Latency, step_fn, time_samples
from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.errors import ConfigError
from tblock_cli.subject.loading import make_subject

from conftest import zoo_spec

CPU = torch.device("cpu")
runner = CliRunner()


def test_cpu_peak_is_exact_for_known_allocations():
    def work():
        a = torch.empty(1_000_000, dtype=torch.uint8)
        b = torch.empty(5_000_000, dtype=torch.uint8)
        del a
        c = torch.empty(250_000, dtype=torch.float32)  # 1,000,000 bytes
        return b, c

    p = profiling.profile_call(work, CPU)
    assert p.peak_bytes == 6_000_000  # a + b, then a freed and c (same size) takes its place
    assert "aten::empty" in p.ops


def test_cpu_peak_ignores_what_existed_before():
    keep = torch.empty(10_000_000, dtype=torch.uint8)
    p = profiling.profile_call(lambda: torch.empty(3_000_000, dtype=torch.uint8), CPU)
    assert p.peak_bytes == 3_000_000 and keep.numel()


def test_cuda_peak_logic(monkeypatch):
    """The CUDA path subtracts what was allocated before and reads the peak after a synchronised run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 5096)
    p = profiling.profile_call(lambda: calls.append("run"), torch.device("cuda", 0))
    assert p.peak_bytes == 4096 and p.source == "torch.cuda.max_memory_allocated"
    assert calls == ["run", "sync", "sync", "reset", "run", "sync"]


def test_latency_statistics_from_samples():
    lat = Latency((1.0, 2.0, 3.0, 4.0, 100.0))
    assert lat.median == 3.0
    assert lat.iqr == pytest.approx(4.0 - 2.0)
    assert lat.noisy  # IQR 2.0 > 10 % of the median 3.0
    assert Latency((1.0, 1.01, 0.99, 1.0)).noisy is False


def test_contention_shows_as_a_slow_tail():
    """A median far above the fastest sample is noisy even when the IQR is tight (threads fighting for cores)."""
    tail = Latency((1.0, 2.0, 2.0, 2.01, 2.02, 2.0, 2.01))  # IQR ~0.5 % of the median, median 2x the minimum
    assert tail.iqr < 0.1 * tail.median and tail.noisy
    report = BenchReport("b", (BenchResult("infer", 8, None, "block", tail, 0, "x", "k", False, None, 8),), {8: {}}, 2, 4, 0.0,
                         {"device": "cpu", "threads": 2})
    warn = [f for f in report.findings if f.status.value == "warn"]
    assert warn and "--threads 1" in warn[0].text


def test_latency_difference_needs_non_overlapping_iqrs():
    from tblock_cli.benchmark.report import latency_verdict

    a, b = Latency((1.0, 1.1, 1.2, 1.3)), Latency((1.15, 1.2, 1.3, 1.4))  # IQRs 1.075-1.225 and 1.19-1.325
    assert latency_verdict(a, b, "off", "on")["verdict"] == "overlap"
    c = Latency((2.0, 2.1, 2.2, 2.3))
    v = latency_verdict(a, c, "off", "on")
    assert v["verdict"] == "faster" and v["ratio"] == pytest.approx(2.15 / 1.15)
    assert latency_verdict(c, a, "on", "off")["verdict"] == "slower"


def test_sampling_batches_fast_calls_and_spends_its_time_measuring():
    calls = []
    clock = []
    lat = time_samples(lambda: calls.append(1), CPU, 0.05, clock)
    assert lat.number_per_sample > 1 and len(lat.samples) >= 5
    assert len(calls) == 1 + lat.number_per_sample * (len(lat.samples) - (1 if lat.number_per_sample == 1 else 0))
    assert clock[0] >= 0.05


def test_train_peak_starts_from_no_gradients():
    """A bias-free Linear, train step: the output (n d) and the weight's gradient (d d) are the only tensors, with
    or without a gradient left from an earlier step (zero_grad(set_to_none=True) is part of the step)."""
    n, d = 64, 32
    lin = torch.nn.Linear(d, d, bias=False)
    x = torch.randn(n, d)
    fn = step_fn(lin, lin, x, "train")
    lin.zero_grad(set_to_none=True)
    first = profiling.profile_call(fn, CPU).peak_bytes
    assert first == 4 * (n * d + d * d)
    assert lin.weight.grad is not None  # left by that step; the next step frees it before it allocates a new one
    assert profiling.profile_call(fn, CPU).peak_bytes <= first


def _seen_need_weights(module, x):
    seen = []
    mhas = [m for m in module.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    hooks = [m.register_forward_hook(lambda m, a, kw, out: seen.append(out[1] is not None), with_kwargs=True) for m in mhas]
    module(x)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("spec", [None, "NeedWeightsOn", "TorchPreLN"])
def test_forced_need_weights_reaches_every_mha(spec):
    cfg = build_config(d_model=32, n_heads=4, layers=1 if spec else 2)
    subject = make_subject(cfg, CPU, torch.float32, zoo_spec(spec) if spec else None)
    subject.module.train()  # weights come back as a tensor exactly when need_weights is on
    x = torch.randn(2, 6, 32)
    for value in (True, False):
        with forced_need_weights(subject.module, value):
            seen = _seen_need_weights(subject.module, x)
        assert seen and all(s == value for s in seen)
    assert _seen_need_weights(subject.module, x) == [spec == "NeedWeightsOn"] * len(seen)  # hooks removed


def test_hooks_switch_the_encoder_layer_off_its_fused_path_and_say_so():
    cfg = build_config(d_model=32, n_heads=4, seq=16)
    subject = make_subject(cfg, CPU, torch.float32, "torch.nn:TransformerEncoderLayer")
    x = torch.randn(2, 16, 32)
    subject.module.eval()
    fn = step_fn(subject, subject.module, x, "infer")
    assert profiling.attention_kernel(profiling.profile_call(fn, CPU).ops)[0] == "TEL fastpath bmm+softmax"
    with forced_need_weights(subject.module, False) as hooked:
        kernel = profiling.attention_kernel(profiling.profile_call(fn, CPU).ops)[0]
    assert kernel == "fastpath bmm+softmax" and hooked == ["MultiheadAttention"]
    r = run_bench(subject, cfg, CPU, torch.float32, seqs=[16], modes=["infer"], need_weights=True, baseline=False, min_time=0.01)
    assert any("off its fused encoder-layer path" in f for f in [x.text for x in r.findings])


def test_need_weights_on_a_block_without_mha_is_a_clear_error():
    cfg = build_config(d_model=32, n_heads=4)
    subject = make_subject(cfg, CPU, torch.float32, zoo_spec("LlamaBlock"))
    with pytest.raises(ConfigError, match="need_weights is its option"):
        run_bench(subject, cfg, CPU, torch.float32, seqs=[8], modes=["infer"], need_weights=True, baseline=False, min_time=0.01)


def _profile(cfg, mode, need_weights):
    subject = make_subject(cfg, CPU, torch.float32)
    subject.module.train(mode == "train")
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model)
    with forced_need_weights(subject.module, need_weights):
        fn = step_fn(subject, subject.module, x, mode)
        fn()
        return profiling.profile_call(fn, CPU)


def test_acceptance_train_mode_saves_the_attention_matrix():
    """d_model 256, 8 heads, batch 2, seq 512, train: off saves at least B H L^2 4 bytes; kernels differ."""
    cfg = build_config(d_model=256, n_heads=8, batch=2, seq=512, dropout=0.0)
    off, on = _profile(cfg, "train", False), _profile(cfg, "train", True)
    assert on.peak_bytes - off.peak_bytes >= 2 * 8 * 512 * 512 * 4
    k_off, k_on = profiling.attention_kernel(off.ops), profiling.attention_kernel(on.ops)
    assert k_off != k_on and k_off == ("SDPA flash-cpu", False) and k_on == ("bmm+softmax", True)


def test_attention_dropout_sends_cpu_sdpa_to_math():
    cfg = build_config(d_model=64, n_heads=4, batch=2, seq=64, dropout=0.1)
    assert profiling.attention_kernel(_profile(cfg, "train", False).ops) == ("SDPA math", True)


def test_infer_fast_path_materialises_either_way():
    cfg = build_config(d_model=64, n_heads=4, batch=2, seq=64)
    for nw in (False, True):
        kernel, materialises = profiling.attention_kernel(_profile(cfg, "infer", nw).ops)
        assert kernel == "fastpath bmm+softmax" and materialises


def test_bench_report_and_findings():
    cfg = build_config(d_model=64, n_heads=4, batch=2, seq=64, dropout=0.0)
    subject = make_subject(cfg, CPU, torch.float32)
    r = run_bench(subject, cfg, CPU, torch.float32, seqs=[32, 64], modes=["infer", "train"], need_weights=True, baseline=True, min_time=0.01)
    assert len(r.results) == 2 * 2 * 3
    assert all(len(x.latency.samples) >= 1 and x.latency.median > 0 for x in r.results)
    assert r.attention_bytes[64] == {"weights_returned": 2 * 64 * 64 * 4, "matrix_per_head": 2 * 4 * 64 * 64 * 4}
    text = " ".join(f.text for f in r.findings)
    assert "infer, seq 64" in text and "still materialises" in text
    assert "train, seq 64: need_weights=False runs SDPA flash-cpu" in text
    train_off = r.pair("train", 64)[0]
    assert train_off.flops == 3 * 2 * 64 * (8 * 64 * 64 + 4 * 64 * 64 + 4 * 64 * 256)


def test_dropout_fallback_is_a_finding():
    cfg = build_config(d_model=32, n_heads=4, batch=2, seq=16, dropout=0.1)
    subject = make_subject(cfg, CPU, torch.float32)
    r = run_bench(subject, cfg, CPU, torch.float32, seqs=[16], modes=["train"], need_weights=False, baseline=False, min_time=0.01)
    assert len(r.results[0].latency.samples) >= 5
    assert any("math kernel" in f and "dropout 0.1" in f for f in [x.text for x in r.findings])


def test_cli_bench_json():
    res = runner.invoke(app, ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "8,16", "--mode", "train",
                              "--need-weights", "--min-time", "0.01", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert len(data["results"]) == 4
    r0 = data["results"][0]
    assert {"mode", "seq", "need_weights", "latency_ms", "peak_bytes", "attention_kernel"} <= set(r0)
    assert {"median", "iqr", "samples"} <= set(r0["latency_ms"])
    assert data["environment"]["torch"] == torch.__version__


@pytest.mark.xdist_group("plot")  # matplotlib's import (~1.5 s) on one worker
def test_cli_bench_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    res = runner.invoke(app, ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "8", "--min-time", "0.01",
                              "--baseline", "torch", "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "vs torch" in res.stdout and "peak memory against seq" in res.stdout
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("args, words", [
    (["--seq", "12,abc"], "comma-separated"),
    (["--seq", "0"], "> 0"),
    (["--mode", "fly"], "--mode"),
    (["--baseline", "jax"], "--baseline"),
    (["--plot", "out.txt"], ".png"),
    (["--plot", "/no/such/dir/x.png"], "does not exist"),
    (["--seq", "2000000", "--batch", "64"], "MiB"),
    (["--block", zoo_spec("LlamaBlock"), "--need-weights"], "need_weights is its option"),
    (["--min-time", "nan"], "--min-time"),
    (["--min-time", "inf"], "--min-time"),
    (["--seq", " "], "comma-separated"),
    (["--plot", "/proc/x.png"], "cannot write"),
    (["--plot", "/tmp"], "is a folder"),
    (["--threads", "0"], "--threads"),
    (["--decode", "0"], "--decode"),
    (["--block", zoo_spec("Good"), "--decode", "4"], "no decode"),
])
def test_cli_bench_bad_input(args, words):
    res = runner.invoke(app, ["bench", "--d-model", "32", "--n-heads", "4", "--min-time", "0.01", *args])
    assert res.exit_code == 2, res.output
    assert words in res.stderr and "Traceback" not in res.output


def test_memory_estimate_grows_quadratically_with_seq():
    cfg = build_config(d_model=64, n_heads=4, batch=1)
    a, b = runtime.estimate_bytes(cfg, seq=4096), runtime.estimate_bytes(cfg, seq=8192)
    assert 3.5 < b / a < 4.1


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    res = runner.invoke(app, ["bench", "--seq", "8", "--plot", "x.png"])
    assert res.exit_code == 2 and "pip install 'tblock[plot]'" in res.stderr


def test_threads_flag_runs_with_that_many_and_says_so():
    torch.set_num_threads(2)
    res = runner.invoke(app, ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "8", "--mode", "infer", "--min-time", "0.01",
                              "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["environment"]["threads"] == 1
    assert torch.get_num_threads() == 2  # restored after the run


def test_save_then_compare(tmp_path):
    saved = tmp_path / "base.json"
    args = ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "8", "--mode", "infer", "--min-time", "0.02"]
    res = runner.invoke(app, [*args, "--save", str(saved)])
    assert res.exit_code == 0, res.output
    data = json.loads(saved.read_text())
    assert data["schema_version"] == 1 and data["command"] == "bench"
    res = runner.invoke(app, [*args, "--compare", str(saved), "--json"])
    out = json.loads(res.stdout)
    assert [c["point"] for c in out["comparison"]] == ["infer seq 8"]
    assert res.exit_code == (1 if out["comparison"][0]["slower"] else 0), res.output  # same config: slower only by noise
    data["results"][0]["peak_bytes"] = data["results"][0]["peak_bytes"] // 2  # the saved run used less memory
    data["results"][0]["latency_ms"]["samples"] = [1e6] * 5  # and was far slower, so latency cannot fail here
    smaller = tmp_path / "smaller.json"
    smaller.write_text(json.dumps(data))
    res = runner.invoke(app, [*args, "--compare", str(smaller)])
    assert res.exit_code == 1 and "bigger" in res.stdout
    other = runner.invoke(app, [*args[:-2], "--min-time", "0.02", "--batch", "3", "--compare", str(saved)])
    assert other.exit_code == 2 and "another config" in other.stderr and "batch" in other.stderr
    junk = tmp_path / "junk.json"
    junk.write_text('{"hello": 1}')
    res = runner.invoke(app, [*args, "--compare", str(junk)])
    assert res.exit_code == 2 and "not a tblock bench run" in res.stderr


def test_breakdown_parts_sum_to_the_whole():
    """The parts' times add up to parts_sum and each share is its time over the whole's median. How close the sum
    comes to the whole is a timing ratio that load moves (0.045 and 1.39 on one loaded machine): a benchmark's
    business (docs/bench.md), not a test's."""
    cfg = build_config(d_model=64, n_heads=4, batch=2, seq=64, dropout=0.0)
    subject = make_subject(cfg, CPU, torch.float32)
    r = run_bench(subject, cfg, CPU, torch.float32, seqs=[64], modes=[], need_weights=False, baseline=False, min_time=0.05,
                  breakdown=True)
    b = r.breakdowns[0]
    names = [p[0] for p in b.parts]
    assert {"attention projections", "attention kernel", "FFN", "norms", "residual adds"} <= set(names)
    calls = {p[0]: p[3] for p in b.parts}
    assert calls["attention projections"] == 4 and calls["norms"] == 2 and calls["residual adds"] == 2
    assert b.parts_sum == pytest.approx(sum(t for _, t, _, _ in b.parts)) and b.parts_sum > 0 and b.whole.median > 0
    assert all(b.share(t) == pytest.approx(t / b.whole.median) for _, t, _, _ in b.parts)
    assert r.to_dict()["breakdown"][0]["parts_sum_ms"] == pytest.approx(b.parts_sum * 1e3)


def test_decode_reports_cached_and_recomputed_with_exact_cache_bytes():
    res = runner.invoke(app, ["bench", "--d-model", "32", "--n-heads", "4", "--seq", "6", "--decode", "10", "--min-time", "0.01",
                              "--layers", "2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    dec = [r for r in data["results"] if r["mode"] == "decode"]
    assert [r["kv_cache"] for r in dec] == [True, False]
    assert all(len(r["per_position_ms"]) == 10 and r["tokens_per_s"] > 0 for r in dec)
    assert dec[0]["cache_bytes"] == 2 * 2 * 2 * (6 + 10) * 32 * 4 == data["decode_analytic_cache_bytes"]
    assert data["config"]["causal"] is True
