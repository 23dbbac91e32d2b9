"""check --tp / --fsdp: the plan from dataflow roles and its refusals, PyTorch's own TP and FSDP2 on 2 gloo ranks
against the unsharded block, and the local world torn down after success and failure."""

import json
import os
from pathlib import Path

import pytest
import torch

import tblock_cli
from tblock_cli.checks import run_checks
from tblock_cli.distributed import prepare
from tblock_cli.distributed.spawn import RankFailure, run_ranks
from tblock_cli.errors import ConfigError
from tblock_cli.report import Status
from tblock_cli.subject.setup import setup

import zoo
from conftest import zoo_spec

SIZE = {"d_model": 64, "n_heads": 4, "causal": True, "threads": 1}


def built(name, **size):
    s = setup(zoo_spec(name), {**SIZE, **size}, same_shape=False)
    return s, s.make()


def sharded(name, only, **flags):
    """The named checks of a zoo block with --tp / --fsdp flags, by check name."""
    s, subject = built(name)
    sharding = prepare(subject, s.cfg, s.device, s.dtype, tp=flags.get("tp"), fsdp=flags.get("fsdp"), tp_plan=None)
    report = run_checks(subject, s.cfg, s.device, s.dtype, only=only, sharding=sharding)
    return {c.name: c for c in report.checks}


def child_pids(pid: int) -> list[str]:
    """A process's children, read per thread from /proc; a thread that ends while it is read (torch's start-up
    spawns and ends threads) has none to give."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += f.read().split()
        except FileNotFoundError:
            continue
    return children


def leftovers() -> tuple[list[str], int]:
    """This process's child processes and the listening TCP sockets it holds."""
    children = child_pids(os.getpid())
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            listening |= {line.split()[9] for line in f.readlines()[1:] if line.split()[3] == "0A"}
    mine = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        mine += target.startswith("socket:[") and target[8:-1] in listening
    return children, mine


def test_plan_from_roles_and_what_it_refuses(tmp_path):
    s, subject = built("LlamaTP")
    plan = prepare(subject, s.cfg, s.device, s.dtype, tp=2, fsdp=None, tp_plan=None).plan
    assert plan.styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                           "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    assert {r["module"]: r["style"] for r in plan.to_dict()["modules"]}["attn_norm"] == "replicate"
    # A full-width QK-norm hides q and k from the dataflow: found again beside v, and sharded like it.
    s, subject = built("FullWidthQKNormWeighted")
    plan = prepare(subject, s.cfg, s.device, s.dtype, tp=2, fsdp=None, tp_plan=None).plan
    assert plan.styles["q_proj"] == plan.styles["k_proj"] == "colwise" and "q_norm" not in plan.styles
    refusals = [("Good", {}, "nn.MultiheadAttention"), ("FusedQKV", {}, "split it into separate q, k, v nn.Linear"),
                ("LlamaTP", {"tp": 3}, "4 attention heads do not split evenly over 3"), ("RawParams", {}, "bare parameter")]
    for name, flags, words in refusals:
        s, subject = built(name)
        with pytest.raises(ConfigError, match=words):
            prepare(subject, s.cfg, s.device, s.dtype, tp=flags.get("tp", 2), fsdp=None, tp_plan=None)
    s, subject = built("LlamaTP")
    good, bad = tmp_path / "plan.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"q_proj": "colwise", "o_proj": "rowwise", "attn_norm": "replicate"}))
    bad.write_text(json.dumps({"q_proj": "colwise", "wq": "rowwise"}))
    plan = prepare(subject, s.cfg, s.device, s.dtype, tp=2, fsdp=None, tp_plan=str(good)).plan
    assert plan.styles == {"q_proj": "colwise", "o_proj": "rowwise"}
    with pytest.raises(ConfigError, match="no module named wq"):
        prepare(subject, s.cfg, s.device, s.dtype, tp=2, fsdp=None, tp_plan=str(bad))
    with pytest.raises(ConfigError, match="--tp-plan needs --tp"):  # an option rule: refused before anything is built
        tblock_cli.check(zoo_spec("LlamaTP"), tp_plan=str(good), **SIZE)


@pytest.mark.xdist_group("hf")  # DTensor and FSDP import dynamo (~1 s): on the worker that imports it anyway
def test_tp_ready_block_passes_tp_and_fsdp_and_leaves_nothing_behind():
    before = leftovers()
    by = sharded("LlamaTP", ("tensor_parallel", "fsdp"), tp=2, fsdp=2)
    tp, fsdp = by["tensor_parallel"], by["fsdp"]
    assert tp.status == Status.PASS and tp.value < 1e-5, tp.detail
    assert set(tp.facts["colwise"]) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert fsdp.status == Status.PASS and fsdp.value < 1e-5 and fsdp.facts["step"] < 1e-5, fsdp.detail
    assert leftovers() == ([], before[1])


def test_global_head_count_fails_tp_naming_the_attention():
    """Split with view(B, T, n_heads, -1): right on one device (the same block with one rank is LlamaTP's maths),
    0.01-0.1 off under --tp 2, first at the attention's output projection."""
    by = sharded("GlobalHeads", ("shape", "finite", "grad_params", "tensor_parallel"), tp=2)
    assert all(by[c].status == Status.PASS for c in ("shape", "finite", "grad_params"))
    tp = by["tensor_parallel"]
    assert tp.status == Status.FAIL and tp.facts["output"] > 1e-3, tp.detail
    assert tp.facts["first_module"] == "o_proj" and tp.facts["role"] == "attn.out"
    assert "global head count" in tp.detail


def _raises_on_rank_1(rank, n, device):
    if rank == 1:
        raise ValueError("boom\nsecond line")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits in a collective that never completes: the parent must end it


def _dies_on_rank_0(rank, n, device):
    if rank == 0:
        os._exit(3)
    return rank


def test_a_failing_rank_is_one_line_and_the_world_is_torn_down():
    before = leftovers()
    with pytest.raises(RankFailure) as raised:
        run_ranks(_raises_on_rank_1, 2, torch.device("cpu"))
    assert (raised.value.rank, str(raised.value)) == (1, "rank 1: ValueError: boom")
    with pytest.raises(RankFailure, match="rank 0: died with exit code 3 and no answer"):
        run_ranks(_dies_on_rank_0, 2, torch.device("cpu"))
    assert leftovers() == ([], before[1])
    assert zoo.DISTRIBUTED["GlobalHeads"]["tp"] == "fail"


def test_bench_tp_counts_collectives_once_and_reports_per_rank():
    """Self times of the calling thread's c10d events, not gloo's worker-thread records that overlap them."""
    from types import SimpleNamespace as E

    from rich.console import Console

    from tblock_cli import render
    from tblock_cli.distributed.timing import RankTiming, TPBench, collective_seconds

    events = [E(key="_c10d_functional::all_reduce", self_cpu_time_total=1_000), E(key="c10d::allreduce_", self_cpu_time_total=30_000),
              E(key="_c10d_functional::wait_tensor", self_cpu_time_total=20_000), E(key="gloo:all_reduce", self_cpu_time_total=60_000),
              E(key="aten::mm", self_cpu_time_total=50_000)]
    assert collective_seconds(events) == pytest.approx(0.051)
    report = TPBench((RankTiming(0, (0.03, 0.02, 0.04), 0.051, 0.102), RankTiming(1, (0.02,), 0.0, 0.1)), (0.01, 0.01), 128,
                     setup(None, {"d_model": 64}).run_info(None, tp=2))
    data = report.to_dict()
    assert [(r["median_s"], r["collective_share"]) for r in data["ranks"]] == [(0.03, 0.5), (0.02, 0.0)]
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parent.parent / "docs" / "tblock.schema.json").read_text())
    jsonschema.validate(data, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "ranks": [{"rank": 0}]}, schema)
    console = Console(width=100, record=True, file=open(os.devnull, "w"))
    console.print(render.tp_bench_view(report))
    text = console.export_text()
    assert "x3.00" in text and "50%" in text and "x2.00" in text


# os._exit skips multiprocessing's own clean-up at exit, so only run_ranks' teardown can end the ranks
# (with it disabled, both were still alive after the parent exited).
HANGS = """
import os, time
import torch
from tblock_cli.distributed.spawn import run_ranks

def hang(rank, n, device):
    open(os.path.join(os.environ["RANKS_IN"], str(rank)), "w").close()  # this rank runs its function now
    time.sleep(120)

try:
    run_ranks(hang, 2, torch.device("cpu"))
except KeyboardInterrupt:
    os._exit(130)
"""


def test_ctrl_c_leaves_no_rank(tmp_path):
    """SIGINT to the parent alone (the ranks sleep on, unaware): the parent must end them before it exits.
    (A terminal's Ctrl-C reaches the whole group; the ranks then stop by themselves as well.)"""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    ranks_in = tmp_path / "ranks_in"
    ranks_in.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "RANKS_IN": str(ranks_in)}
    p = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    kids, deadline = [], time.monotonic() + 120
    try:
        while len(kids) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            kids = child_pids(p.pid)
        assert len(kids) == 2, "the ranks never started"
        while len(os.listdir(ranks_in)) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert sorted(os.listdir(ranks_in)) == ["0", "1"], "the ranks never reached their function"
        os.kill(p.pid, signal.SIGINT)
        assert p.wait(timeout=30) == 130
    finally:  # a failed assertion above must not leave the script and its ranks behind for the next test
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    alive = [k for k in kids if os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z"]
    assert alive == []
