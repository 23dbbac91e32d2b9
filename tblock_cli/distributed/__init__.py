"""Checks past one device: the block under tensor parallelism (`tp`) and FSDP2 (`fsdp`) on PyTorch's own engine,
the plan that shards it (`plan`), and the local ranks that run it (`spawn`). torch is imported by the modules, not here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """What `check --tp N / --fsdp N / --tp-plan FILE` asked for, with the tensor-parallel plan resolved."""

    tp: int | None = None
    fsdp: int | None = None
    plan: object = None  # plan.Plan when tp is set


def prepare(subject, cfg, device, dtype, *, tp: int | None, fsdp: int | None, tp_plan: str | None) -> Sharding | None:
    """The sharding to check, or None; ConfigError (exit 2) for what cannot be sharded, before anything runs."""
    from tblock_cli.errors import ConfigError

    if tp_plan is not None and not tp:
        raise ConfigError("--tp-plan needs --tp N")
    for flag, n in (("--tp", tp), ("--fsdp", fsdp)):
        if n is not None and n < 2:
            raise ConfigError(f"{flag} {n}: a world of fewer than 2 ranks shards nothing; give 2 or more")
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
