"""The tensor_parallel and fsdp checks: verdicts on what the ranks measured (the engine, distributed/, returns facts)."""

from __future__ import annotations

import math

from tblock_cli.checks.result import failed, passed, skipped


def check_tensor_parallel(ctx):
    """Catches: with `--tp N`: outputs, input gradients or full parameter gradients of the block sharded by PyTorch's
    `parallelize_module` (plan from the dataflow roles, or `--tp-plan`) that differ from the unsharded block with
    the same weights; names the first module whose output differs ([distributed.md](distributed.md))"""
    sharding = ctx.sharding
    if sharding is None or not sharding.tp:
        return skipped("tensor_parallel.off")
    n, plan = sharding.tp, sharding.plan
    sharded = {"ranks": n, "colwise": sorted(k for k, s in plan.styles.items() if s == "colwise"),
               "rowwise": sorted(k for k, s in plan.styles.items() if s == "rowwise"), "plan": plan.to_dict()}
    passes = sharding.tensor_parallel(ctx.subject, ctx.cfg, ctx.device, ctx.dtype)
    e = passes.failure
    if e is not None:
        return failed("tensor_parallel.raised", e.where, rank=e.rank, error=e.error, where=e.where,
                      role=plan.roles.get(e.where or "", ""), **sharded)
    got = passes.measured
    # The battery's tolerance per dtype: sharded matmuls add partial sums in another order, and float32 agreed to
    # 1.4e-7..4.2e-7 (relative) on every TP-ready block measured; the global head count is off by 3.3e-2.
    limit = ctx.tol
    worst = max(got["output"], got["input_grad"], got["param_grad"])
    first = got["first_module"]
    facts = {**sharded, **got, "limit": limit, "role": plan.roles.get(first or "", "")}
    if not math.isfinite(worst) or worst > limit:
        return failed("tensor_parallel.differs", worst, **facts)
    return passed("tensor_parallel.equal", worst, **facts)


def check_fsdp(ctx):
    """Catches: with `--fsdp N`: under `fully_shard`, each rank its own micro-batch, gradients that differ from one
    process's on the whole batch (averaged as FSDP reduces them), or parameters that differ after the same optimizer
    step"""
    sharding = ctx.sharding
    if sharding is None or not sharding.fsdp:
        return skipped("fsdp.off")
    n = sharding.fsdp
    passes = sharding.fully_sharded(ctx.subject, ctx.cfg, ctx.device, ctx.dtype)
    e = passes.failure
    if e is not None:
        return failed("fsdp.raised", e.where, rank=e.rank, error=e.error, where=e.where, ranks=n)
    got = passes.measured
    worst = max(got["output"], got["input_grad"], got["param_grad"], got["step"])
    facts = {"ranks": n, "batch": n * ctx.cfg.batch, "limit": ctx.tol, **got}
    if not math.isfinite(worst) or worst > ctx.tol:
        return failed("fsdp.differs", worst, **facts)
    return passed("fsdp.equal", worst, **facts)
