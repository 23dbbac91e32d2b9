"""N local ranks for one function: processes on loopback with gloo (CPU) or NCCL (GPUs), or the world torchrun made.

The parent owns the rendezvous (a TCPStore on 127.0.0.1, port chosen by the OS) and every child: on
success, on a rank's failure and on Ctrl-C it terminates, then kills, whatever is still running, and
closes the store, so no process and no listening port outlives the call. A rank's exception comes
back as one line naming the rank; a rank that dies without one is named with its exit code.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import queue
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tblock_cli.distributed.ranks import is_rank_zero, under_torchrun  # noqa: F401 - part of this module's vocabulary
from tblock_cli.errors import ConfigError, one_line

# How long the parent waits for all ranks. A d_model 64 check takes a few seconds; a 7B-size layer on
# CPU ~11 s per forward+backward (PYTORCH-NOTES); ten minutes leaves room and still ends a hung world.
RANK_TIMEOUT_S = 600
# How long a terminated rank gets to exit before it is killed.
GRACE_S = 3.0
LOOPBACK = "127.0.0.1"
# How long to wait, after a first failure, for the other ranks' answers or deaths: a peer whose partner failed
# sees a broken connection, and the partner's own error (or death) is the one to report.
PEER_WAIT_S = 2.0


@dataclass(frozen=True)
class RankFailure(Exception):
    """A rank raised or died; `error` is one line."""

    rank: int
    error: str
    where: str | None = None  # the module that was running when it raised, if known

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.error}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def run_ranks(fn: Callable, n: int, device: torch.device, *args, preload: tuple[str, ...] = ()) -> object:
    """fn(rank, world, device, *args) on n ranks; rank 0's return value. Raises RankFailure or ConfigError.

    `preload`: modules fn imports, imported once here before forking rather than in every child."""
    if under_torchrun():
        return _in_this_world(fn, n, device, *args)
    if n < 2:
        raise ConfigError(f"a world of {n} rank(s) shards nothing; give 2 or more")
    check_world(n, device)
    import multiprocessing as mp

    from torch.distributed import TCPStore

    # fork: the children share the built block with no pickling and start in milliseconds; CUDA cannot
    # survive a fork, so GPUs spawn and the block travels pickled (user files re-imported first).
    method = "spawn" if device.type == "cuda" or "fork" not in mp.get_all_start_methods() else "fork"
    ctx = mp.get_context(method)
    payload = args if method == "fork" else (pickle.dumps(args), _user_files())
    if method == "fork":
        for name in preload:
            importlib.import_module(name)
    store = TCPStore(LOOPBACK, 0, n, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    results = ctx.Queue()
    procs = []
    try:
        for rank in range(n):
            p = ctx.Process(target=_child, args=(fn, rank, n, device, store.port, method, payload, results), daemon=True)
            p.start()
            procs.append(p)
        return _collect(procs, results, n)
    finally:
        _tear_down(procs)
        results.close()
        results.join_thread()
        del store


def check_world(n: int, device: torch.device, flag: str = "a world of") -> None:
    """Refuse, before any process starts, a local world this machine cannot run: one rank per GPU on CUDA, and on
    CPU no more ranks than cores (each rank is a process holding the block; 100,000 of them forked until the
    machine fell over). Under torchrun the world is torchrun's, already running."""
    if under_torchrun():
        return
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if n > have:
            raise ConfigError(f"{flag} {n}: {n} ranks on CUDA need {n} GPUs and {have} are visible; "
                              f"give at most {have}, or use --device cpu (gloo)")
        return
    cores = os.cpu_count() or 1
    if n > cores:
        raise ConfigError(f"{flag} {n}: each rank is a process of its own and this machine has {cores} CPU core(s); "
                          f"give at most {cores} (or run under torchrun on more machines)")


def _collect(procs, results, n: int) -> object:
    """Wait for every rank's answer; the first failure (a raise, or a death with no answer) ends the world."""
    answers: dict[int, object] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    while len(answers) < n:
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in answers and p.exitcode is not None:
                    time.sleep(0.2)  # its answer may still be in the pipe
                    if results.empty():
                        raise RankFailure(rank, _death(p.exitcode)) from None
                    break
            if time.monotonic() > deadline:
                raise RankFailure(min(set(range(n)) - set(answers)), f"no answer in {RANK_TIMEOUT_S} s") from None
            continue
        if not ok:
            raise _cause((RankFailure(rank, *value[:2]), value[2]), results, procs, answers)
        answers[rank] = value
    return answers[0]


def _cause(first: tuple[RankFailure, float], results, procs, answers: dict) -> RankFailure:
    """The failure to report. A rank whose peer failed first sees only a broken connection, in the backend's own
    words (which change with the release): so wait a moment, until every other rank has answered or ended, and name
    a rank that died with no answer (the root cause, whatever its peers said), else the failure that happened first
    (each rank stamps its own with the system's monotonic clock: a peer's broken connection comes after the cause)."""
    failures = [first]
    end = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < end:
        try:
            rank, ok, value = results.get(timeout=0.05)
            if ok:
                answers[rank] = value
            else:
                failures.append((RankFailure(rank, *value[:2]), value[2]))
            continue
        except queue.Empty:
            pass
        said = {f.rank for f, _ in failures} | set(answers)
        if all(p.exitcode is not None for r, p in enumerate(procs) if r not in said):
            break
    said = {f.rank for f, _ in failures} | set(answers)
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in said and p.exitcode not in (None, 0)]
    if dead:
        return RankFailure(dead[0][0], _death(dead[0][1]))
    return min(failures, key=lambda f: f[1])[0]


def _death(code: int) -> str:
    if code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name} with no answer"
    return f"died with exit code {code} and no answer"


def _tear_down(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _user_files() -> dict[str, str]:
    """Blocks loaded from a file live in a module named tblock_user_*: a spawned child must load it before unpickling."""
    return {name: m.__file__ for name, m in list(sys.modules.items()) if name.startswith("tblock_user_") and getattr(m, "__file__", None)}


def _child(fn, rank: int, n: int, device: torch.device, port: int, method: str, payload, results) -> None:
    # A rank prints nothing: rank 0's answer is the output, and gloo's exit notes are noise.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    torch.set_num_threads(1)  # N ranks share the cores; a forked OpenMP pool must not be reused either
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface() or "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface() or "lo")
    try:
        if method == "fork":
            args = payload
        else:
            blob, files = payload
            for name, path in files.items():
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            args = pickle.loads(blob)
        import torch.distributed as dist

        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        store = dist.TCPStore(LOOPBACK, port, n, is_master=False, timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
        dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=n)
        results.put((rank, True, fn(rank, n, device, *args)))
    except KeyboardInterrupt:
        pass  # the parent tears the world down and says so
    except BaseException as e:  # noqa: BLE001 - any failure is this rank's answer, sent before its peers lose it
        results.put((rank, False, (one_line(e), getattr(e, "tblock_where", None), time.monotonic())))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        results.close()
        results.join_thread()


def _in_this_world(fn, n: int, device: torch.device, *args) -> object:
    """Under torchrun: this process is one rank of the world torchrun made; every rank returns rank 0's answer."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != n:
        raise ConfigError(f"torchrun started {world} ranks but {n} were asked; give the same number")
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device))
    try:
        value = fn(rank, n, device, *args)
    except Exception as e:  # noqa: BLE001 - the block raised on this rank
        raise RankFailure(rank, one_line(e), getattr(e, "tblock_where", None)) from None
    answer = [value]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]
