"""FSDP2's rank passes: the block under PyTorch's `fully_shard`, each rank its own micro-batch, against one process on
the whole batch; the differences come back as facts (checks/sharded.py judges them)."""

from __future__ import annotations

import torch

from tblock_cli.distributed import RankPasses

# The step is plain SGD: it moves each parameter by lr x its gradient, so the sharded step applied to the wrong
# shard shows at the gradients' scale. AdamW was tried first and gave a false alarm on the built-in block: it
# normalises each element, so a gradient near zero (a key bias, legitimately ~0) that rounds to 1e-9 on one
# side and 0 on the other moves by ~lr on one side only (1.7e-3 apart).
LR = 0.1
# What a rank imports, imported before the ranks fork (as for tensor_parallel: FSDP2 alone is 1.5 s, torch._dynamo 2 s).
RANK_MODULES = ("torch.distributed.device_mesh", "torch.distributed.fsdp", "torch._dynamo")


def measure(subject, cfg, device: torch.device, dtype: torch.dtype, sharding) -> RankPasses:
    """The ranks' passes: each rank its micro-batch through the fully sharded block, against one process on the whole batch."""
    from tblock_cli.distributed.spawn import RankFailure, run_ranks

    shape = (cfg.batch, cfg.seq, cfg.d_model)
    try:
        got = run_ranks(fsdp_rank, sharding.fsdp, device, subject, cfg.seed, shape, dtype, preload=RANK_MODULES)
    except RankFailure as e:
        return RankPasses(sharding.fsdp, {}, e)
    return RankPasses(sharding.fsdp, got)


def fsdp_rank(rank: int, n: int, device: torch.device, subject, seed: int, shape: tuple, dtype: torch.dtype) -> dict:
    """On one rank: the whole batch in one unsharded copy; this rank's micro-batch through the fully sharded block."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tblock_cli.distributed.rankpass import forward_backward, full, grad_diffs, inputs, same_weights, world_max
    from tblock_cli.probes import rel_diff

    module = same_weights(subject.module, device)
    ref = copy.deepcopy(module)
    B, T, d = shape
    x, v = inputs(seed, (n * B, T, d), device, dtype)
    expected = forward_backward(subject.like(ref), x, v)
    fully_shard(module, mesh=init_device_mesh(device.type, (n,)))
    mine = slice(rank * B, (rank + 1) * B)
    got = forward_backward(subject.like(module), x[mine], v[mine])
    # FSDP averages the ranks' gradients: the mean of n micro-batch gradients is the whole batch's over n.
    grads = grad_diffs(got.grads, expected.grads, scale=1.0 / n)
    names = list(grads)
    for name, p in ref.named_parameters():
        p.grad = None if expected.grads[name] is None else expected.grads[name] / n
    for m in (ref, module):
        torch.optim.SGD([p for p in m.parameters() if p.grad is not None], lr=LR).step()
    after = dict(module.named_parameters())
    steps = [rel_diff(full(after[name]).detach(), p.detach()) for name, p in ref.named_parameters()]
    gx = float("inf") if got.x_grad is None or expected.x_grad is None else rel_diff(got.x_grad, expected.x_grad[mine])
    per = world_max([rel_diff(got.out, expected.out[mine]), gx, *[grads[k] for k in names], max(steps, default=0.0)], device)
    worst = max(range(len(names)), key=lambda i: per[2 + i]) if names else None
    return {"output": per[0], "input_grad": per[1], "param_grad": per[2 + worst] if names else 0.0,
            "worst_param": names[worst] if names else None, "step": per[-1]}
