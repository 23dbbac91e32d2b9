"""Tensor parallelism's rank passes: the block sharded by PyTorch's `parallelize_module` against the unsharded block,
same weights; the differences come back as facts (checks/sharded.py judges them)."""

from __future__ import annotations

import torch

from tblock_cli.distributed import RankPasses

NO_MODULE = 1 << 30  # "no module output differed", as the minimum over ranks
# What a rank imports, imported before the ranks fork: the DTensor modules (1.5 s), and torch._dynamo, which
# distribute_tensor's dynamo-disabling wrapper imports on its first call (2 s of CPU in every rank otherwise).
RANK_MODULES = ("torch.distributed.device_mesh", "torch.distributed.tensor.parallel", "torch._dynamo")


def measure(subject, cfg, device: torch.device, dtype: torch.dtype, sharding) -> RankPasses:
    """The ranks' passes: the block sharded by the plan against the unsharded block, same weights (maxima over ranks)."""
    from tblock_cli.distributed.spawn import RankFailure, run_ranks

    shape = (cfg.batch, cfg.seq, cfg.d_model)
    try:
        got = run_ranks(tp_rank, sharding.tp, device, subject, sharding.plan.styles, cfg.seed, shape, dtype, preload=RANK_MODULES)
    except RankFailure as e:
        return RankPasses(sharding.tp, {}, e)
    return RankPasses(sharding.tp, got)


def tp_rank(rank: int, n: int, device: torch.device, subject, styles: dict, seed: int, shape: tuple, dtype: torch.dtype) -> dict:
    """On one rank: the unsharded block, then the same weights sharded by the plan; differences as maxima over ranks."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tblock_cli.distributed import rankpass as c
    from tblock_cli.probes import TOLERANCE, rel_diff

    module = c.same_weights(subject.module, device)
    x, v = c.inputs(seed, shape, device, dtype)
    expected = c.forward_backward(subject.like(copy.deepcopy(module)), x, v)
    mesh = init_device_mesh(device.type, (n,))
    parallelize_module(module, mesh, {name: (ColwiseParallel if s == "colwise" else RowwiseParallel)() for name, s in styles.items()})
    got = c.forward_backward(subject.like(module), x, v)
    # The first module (in the order modules finished) whose output differs, on any rank.
    ref_outputs, limit = dict(expected.outputs), TOLERANCE[dtype]
    order = [name for name, _ in got.outputs]
    diffs = [c.diff_local(t, ref_outputs[name], rank, n) if name in ref_outputs else None for name, t in got.outputs]
    differs = [i for i, d in enumerate(diffs) if d is not None and not d <= limit]
    first = c.world_min(differs[0] if differs else NO_MODULE, device)
    grads = c.grad_diffs(got.grads, expected.grads)
    names = list(grads)
    x_grad = float("inf") if (got.x_grad is None) != (expected.x_grad is None) else \
        0.0 if got.x_grad is None else rel_diff(got.x_grad, expected.x_grad)
    per = c.world_max([rel_diff(got.out, expected.out), x_grad, *[grads[k] for k in names]], device)
    worst = max(range(len(names)), key=lambda i: per[2 + i]) if names else None
    return {"output": per[0], "input_grad": per[1], "param_grad": per[2 + worst] if names else 0.0,
            "worst_param": names[worst] if names else None, "first_module": order[first] if first < len(order) else None}
