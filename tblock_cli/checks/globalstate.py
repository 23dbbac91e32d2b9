"""The process-wide state a block's forward must leave alone: torch's modes and defaults, its numerics switches, and
the random streams. The battery reads the switches before it starts and after every check, notes what changed and
puts it back (one check's leak does not break the next); the global_state check judges what was noted, and whether
a forward reseeds a random stream (the same dropout masks at every step, the caller's data order replayed)."""

from __future__ import annotations

import functools
import random
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed, passed, warned
from tblock_cli.probes import kept_modes

SEEDS = (1, 2)  # the two starting points of each random stream: a stream a forward reseeds ends in one place from both


@dataclass(frozen=True)
class Switch:
    name: str
    get: Callable[[], object]
    set: Callable[[object], None]
    severe: bool  # changes what later code computes or whether it trains (a failure); else numerics or speed (a warning)


def _autocast(device: str) -> Switch | None:
    if hasattr(torch, "is_autocast_enabled") and hasattr(torch, "set_autocast_enabled"):
        try:
            torch.is_autocast_enabled(device)  # torch >= 2.4 takes the device type
        except TypeError:
            return None
        return Switch(f"autocast ({device})", lambda: torch.is_autocast_enabled(device),
                      lambda v: torch.set_autocast_enabled(device, v), True)
    return None


def _attribute(owner, attr: str, name: str) -> Switch:
    return Switch(name, lambda: getattr(owner, attr), lambda v: setattr(owner, attr, v), False)


def _sdp(kind: str) -> Switch | None:
    cuda = torch.backends.cuda
    get, enable = getattr(cuda, f"{kind}_sdp_enabled", None), getattr(cuda, f"enable_{kind}_sdp", None)
    return None if get is None or enable is None else Switch(f"{kind} SDPA enabled", get, enable, False)


@functools.cache
def switches() -> tuple[Switch, ...]:
    """Every switch read, where this torch has it (found once: the battery reads them after every check)."""
    found = [
        Switch("grad mode", torch.is_grad_enabled, torch.set_grad_enabled, True),
        Switch("default dtype", torch.get_default_dtype, torch.set_default_dtype, True),
        Switch("anomaly detection", torch.is_anomaly_enabled, torch.set_anomaly_enabled, True),
        Switch("deterministic algorithms",
               lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
               lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]), True),
        _autocast("cpu"), _autocast("cuda"),
        Switch("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, False),
        _attribute(torch.backends.cuda.matmul, "allow_tf32", "cuda matmul allow_tf32"),
        _attribute(torch.backends.cudnn, "allow_tf32", "cudnn allow_tf32"),
        _attribute(torch.backends.cudnn, "benchmark", "cudnn benchmark"),
        _attribute(torch.backends.cudnn, "deterministic", "cudnn deterministic"),
        _sdp("flash"), _sdp("mem_efficient"), _sdp("math"),
        Switch("threads", torch.get_num_threads, torch.set_num_threads, False),
    ]
    if hasattr(torch, "get_default_device"):
        found.append(Switch("default device", torch.get_default_device, torch.set_default_device, True))
    return tuple(s for s in found if s is not None)


def snapshot() -> dict[str, object]:
    return {s.name: s.get() for s in switches()}


def changes(before: dict, after: dict) -> dict[str, list[str]]:
    """Switch name -> [before, after] as words, for each that differs."""
    return {k: [str(before[k]), str(after.get(k))] for k in before if after.get(k) != before[k]}


def restore(before: dict) -> None:
    """Each switch that differs from `before` set back."""
    for s in switches():
        if s.name in before and s.get() != before[s.name]:
            s.set(before[s.name])


def severe(names) -> list[str]:
    kinds = {s.name: s.severe for s in switches()}
    return [n for n in names if kinds.get(n, True)]


class _Streams:
    """The random streams a block could reseed (torch's on the CPU and the run's device, Python's, NumPy's where
    imported): each set to a seed, and read back as a value two runs can compare; the caller's put back at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        self.numpy = sys.modules.get("numpy")

    def __enter__(self):
        self.saved = (torch.random.get_rng_state(), torch.cuda.get_rng_state(self.cuda) if self.cuda else None,
                      random.getstate(), self.numpy.random.get_state() if self.numpy else None)
        return self

    def __exit__(self, *exc):
        cpu, cuda, py, np_state = self.saved
        torch.random.set_rng_state(cpu)
        if self.cuda:
            torch.cuda.set_rng_state(cuda, self.cuda)
        random.setstate(py)
        if self.numpy:
            self.numpy.random.set_state(np_state)

    def seed(self, seed: int) -> None:
        torch.random.default_generator.manual_seed(seed)
        if self.cuda:
            torch.cuda.manual_seed(seed)
        random.seed(seed)
        if self.numpy:
            self.numpy.random.seed(seed)

    def read(self) -> dict[str, object]:
        got = {"torch": torch.random.get_rng_state().tolist(), "python": random.getstate()}
        if self.cuda:
            got["torch (cuda)"] = torch.cuda.get_rng_state(self.cuda).tolist()
        if self.numpy:
            got["numpy"] = str(self.numpy.random.get_state()[1].tolist())
        return got


def flipped(module: nn.Module, was: dict[str, bool]) -> list[str]:
    """The submodules whose training flag differs from `was` (name -> flag), each set back to it."""
    out = []
    for name, m in module.named_modules():
        if name in was and m.training != was[name]:
            out.append(name or type(module).__name__)
            m.training = was[name]
    return out


def bare_forwards(ctx: Context) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """Two eval and two train forwards, each from other seeds of the random streams, with no context of tblock's
    around them (a block that turns grad mode off inside a caller's no_grad leaks nothing visible after it). Returns
    (mode -> streams left in the same state from both starts, switch -> [before, after] one of them left changed,
    mode -> submodules whose train/eval flag a forward changed)."""
    module, reseeds, changed, modes = ctx.subject.module, {}, {}, {}
    x = ctx.x()
    base = snapshot()
    with _Streams(ctx.device) as streams, kept_modes(module):
        for mode in ("eval", "train"):
            module.train(mode == "train")
            was = {name: m.training for name, m in module.named_modules()}  # a train() override's choices kept
            ends = []
            for seed in SEEDS:
                streams.seed(seed)
                try:
                    ctx.subject(x.clone())
                finally:
                    changed.update(changes(base, snapshot()))
                    restore(base)
                    modes[mode] = sorted(set(modes.get(mode, [])) | set(flipped(module, was)))
                ends.append(streams.read())
            same = [name for name in ends[0] if ends[0][name] == ends[1][name]]
            if same:
                reseeds[mode] = same
    return reseeds, changed, {m: v for m, v in modes.items() if v}


def check_global_state(ctx: Context) -> Outcome:
    """Catches: a forward that leaves torch's process-wide state changed (grad mode off, the default dtype or device,
    autocast, anomaly or deterministic mode; numerics switches such as TF32, matmul precision, SDPA backends or the
    thread count are a **warning**), seen around every check of the battery; a forward that reseeds torch's, Python's
    or NumPy's random stream (the same dropout masks at every step); a forward that switches a submodule between
    train and eval (`self.dropout.eval()` inside it: dropout off in training from then on)"""
    from tblock_cli.checks.training import too_large

    large = too_large(ctx) is not None  # above the training checks' size: the switches noted, no forwards of its own
    reseeds, own, modes = ({}, {}, {}) if large else bare_forwards(ctx)
    seen = list(ctx.state_changes) + ([("a bare forward", own)] if own else [])
    # per switch, the first check it changed during (later notes of the same switch overwritten by earlier ones)
    changed = {name: (check, values) for check, diff in reversed(seen) for name, values in diff.items()}
    facts = {"changed": {k: {"check": c, "before": v[0], "after": v[1]} for k, (c, v) in changed.items()},
             "reseeds": reseeds, "modes": modes, "rng_probed": not large}
    bad = severe(changed)
    if bad:
        return failed("global_state.changed", len(bad), switches=bad, **facts)
    if modes:
        return failed("global_state.modes", sum(map(len, modes.values())), **facts)
    if reseeds:
        return failed("global_state.reseeds", sum(map(len, reseeds.values())), **facts)
    if changed:
        return warned("global_state.switched", len(changed), switches=list(changed), **facts)
    return passed("global_state.kept", 0, **facts)
