"""The block past one device: its rank passes under tensor parallelism (`tp`) and FSDP2 (`fsdp`) on PyTorch's own
engine, the plan that shards it (`plan`), and the local ranks that run it (`spawn`). The engine returns facts
(`RankPasses`); the verdicts are checks' (checks/sharded.py), and neither package imports the other: a check reaches
the engine through the `Sharding` it is handed. torch is imported by the modules, not here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankPasses:
    """What the ranks measured: relative differences from the unsharded block (maxima over ranks), or how a rank failed."""

    ranks: int
    measured: dict  # output, input_grad, param_grad (+ worst_param, first_module for tp; step for fsdp)
    failure: object = None  # spawn.RankFailure (rank, error, where) when a rank raised or died


@dataclass(frozen=True)
class Sharding:
    """What `check --tp N / --fsdp N / --tp-plan FILE` asked for, with the tensor-parallel plan resolved; the rank
    passes run through it, so a check needs no import of this package."""

    tp: int | None = None
    fsdp: int | None = None
    plan: object = None  # plan.Plan when tp is set

    def tensor_parallel(self, subject, cfg, device, dtype) -> RankPasses:
        from tblock_cli.distributed import tp

        return tp.measure(subject, cfg, device, dtype, self)

    def fully_sharded(self, subject, cfg, device, dtype) -> RankPasses:
        from tblock_cli.distributed import fsdp

        return fsdp.measure(subject, cfg, device, dtype, self)


def prepare(subject, cfg, device, dtype, *, tp: int | None, fsdp: int | None, tp_plan: str | None) -> Sharding | None:
    """The sharding to check, or None; ConfigError (exit 2) for what cannot be sharded, before anything runs.
    The flags' own rules (--tp-plan needs --tp, 2 ranks or more) are judged by tblock_cli.options."""
    from tblock_cli.errors import ConfigError

    if not tp and not fsdp:
        return None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--tp/--fsdp run on gloo (CPU) or NCCL (CUDA), not {device.type}; use --device cpu")
    plan = None
    if tp:
        from tblock_cli.distributed.plan import plan_for

        plan = plan_for(subject, cfg, device, dtype, tp, tp_plan)
    from tblock_cli.distributed.spawn import check_world

    for flag, n in (("--tp", tp), ("--fsdp", fsdp)):  # after the plan (whose refusals say more), before any rank
        if n:
            check_world(n, device, flag)
    return Sharding(tp, fsdp, plan)
