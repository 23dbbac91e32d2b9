"""bench --tp N: what sharding costs at the user's size: per-rank latency of the sharded block and the share in collectives."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from tblock_cli.report import RunInfo

# Profiler events that are communication, by self time on the calling thread: DTensor's functional collectives
# (_c10d_functional::all_reduce, ::wait_tensor, ...) and c10d's ops (c10d::allreduce_). gloo's own records
# (gloo:all_reduce) run on its worker thread, overlapping those: counting them too would count the time twice.
COLLECTIVE_MARKS = ("c10d", "nccl:", "record_param_comms")
WARMUP = 3  # untimed calls first: DTensor caches its sharding propagation on the first ones
CALLS = 10  # timed calls per rank, and as many profiled: the median of 10 is stable to a few percent here


@dataclass(frozen=True)
class RankTiming:
    rank: int
    samples: tuple[float, ...]  # seconds per forward + backward (eval mode, grads on)
    collective_s: float  # profiled time inside collectives over the profiled calls
    profiled_s: float  # wall time of the profiled calls

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def collective_share(self) -> float:
        return self.collective_s / self.profiled_s if self.profiled_s else 0.0


@dataclass(frozen=True)
class TPBench:
    ranks: tuple[RankTiming, ...]
    unsharded: tuple[float, ...]  # the same call on one process, unsharded (rank 0), seconds
    seq: int
    run: RunInfo | None = None
    ok: bool = True  # a measurement, not a verdict

    @property
    def unsharded_median(self) -> float:
        return statistics.median(self.unsharded)

    def to_dict(self) -> dict:
        run = self.run or RunInfo("", {}, {})
        return run.envelope("bench", True, {"tp": len(self.ranks), "seq": self.seq, "unsharded_median_s": self.unsharded_median,
                                            "unsharded_samples": list(self.unsharded),
                                            "ranks": [{"rank": r.rank, "median_s": r.median, "samples": list(r.samples),
                                                       "collective_share": r.collective_share} for r in self.ranks]})


def collective_seconds(events) -> float:
    """Self CPU time of the profiler's collective events (names as c10d, gloo and NCCL record them)."""
    return sum(e.self_cpu_time_total for e in events if any(m in e.key for m in COLLECTIVE_MARKS)) / 1e6


def bench_rank(rank: int, n: int, device: torch.device, subject, styles: dict, seed: int, shape: tuple,
               dtype: torch.dtype, calls: int) -> list:
    """On one rank: time the unsharded call (rank 0's is kept), then the sharded one, then profile it."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.profiler import ProfilerActivity, profile

    from tblock_cli.distributed import rankpass as c

    module = c.same_weights(subject.module, device)
    x, v = c.inputs(seed, shape, device, dtype)
    # The one-process baseline on rank 0 alone: the other ranks wait, so it has the machine as one process would.
    unsharded = _times(subject.like(copy.deepcopy(module)), x, v, calls, device) if rank == 0 else []
    dist.barrier()
    parallelize_module(module, init_device_mesh(device.type, (n,)),
                       {name: (ColwiseParallel if s == "colwise" else RowwiseParallel)() for name, s in styles.items()})
    sharded = subject.like(module)
    samples = _times(sharded, x, v, calls, device)
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(calls):
            _step(sharded, x, v)
        _sync(device)
        profiled = time.perf_counter() - started
    mine = RankTiming(rank, tuple(samples), collective_seconds(prof.key_averages()), profiled)
    everyone = [None] * n
    dist.all_gather_object(everyone, mine)
    return [everyone, unsharded]


def _step(subject, x, v) -> None:
    """One train-mode forward + backward from grads = None, as bench's train mode times it."""
    from tblock_cli.distributed.rankpass import full

    for p in subject.module.parameters():
        p.grad = None
    with torch.enable_grad():
        (full(subject(x, None)).float() * v.float()).sum().backward()


def _times(subject, x, v, calls: int, device: torch.device) -> list[float]:
    for _ in range(WARMUP):
        _step(subject, x, v)
    out = []
    for _ in range(calls):
        _sync(device)
        started = time.perf_counter()
        _step(subject, x, v)
        _sync(device)
        out.append(time.perf_counter() - started)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_tp_bench(subject, cfg, device: torch.device, dtype: torch.dtype, plan, n: int, run: RunInfo, calls: int = CALLS) -> TPBench:
    from tblock_cli.distributed.spawn import RankFailure, run_ranks
    from tblock_cli.distributed.tp import RANK_MODULES
    from tblock_cli.errors import MeasureError

    try:
        everyone, unsharded = run_ranks(bench_rank, n, device, subject, plan.styles, cfg.seed,
                                        (cfg.batch, cfg.seq, cfg.d_model), dtype, calls, preload=RANK_MODULES)
    except RankFailure as e:
        raise MeasureError(f"bench --tp {n}: {e}" + (f" (in `{e.where}`)" if e.where else "")) from None
    return TPBench(tuple(everyone), tuple(unsharded), cfg.seq, run)
