"""The sentence of every outcome of the checks past one device (tensor_parallel, fsdp), by kind, from its facts."""

from __future__ import annotations


def _tp_where(f: dict) -> str:
    first = f.get("first_module")
    if not first:
        return ""
    if f.get("role") == "attn.out":
        return (f"; the first module whose output differs is `{first}` (attn.out): the attention feeding it computes "
                f"something else on each rank's heads: heads split with the global head count (view(B, T, n_heads, -1)) "
                f"instead of view(B, T, -1, head_dim), or a norm over the full q/k width applied to each rank's slice")
    if f.get("role") == "ffn.out":
        return (f"; the first module whose output differs is `{first}` (ffn.out): something between the FFN's "
                f"column-sharded projections and it needs all the hidden units (a norm or sum over the hidden width?)")
    return f"; the first module whose output differs is `{first}`" + (f" ({f['role']})" if f.get("role") else "")


def _tp_raised(f: dict) -> str:
    where = f"`{f['where']}`" + (f" ({f['role']})" if f.get("role") else "") if f.get("where") else "the forward"
    return (f"rank {f['rank']}: {where} raised under --tp {f['ranks']}: {f['error']}; a module that needs the full "
            f"width of a column-sharded activation (a norm over q's full width, a reshape to the global width?)")


MESSAGES = {
    "tensor_parallel.off": "run with --tp N to check the block tensor-parallel",
    "tensor_parallel.equal": lambda f: (f"--tp {f['ranks']} ({len(f['colwise'])} colwise, {len(f['rowwise'])} rowwise): outputs, "
                                        f"input and parameter gradients equal the unsharded block's (max relative diff, limit {f['limit']:g})"),
    "tensor_parallel.differs": lambda f: (f"--tp {f['ranks']}: the sharded block differs from the unsharded one with the same weights: "
                                          f"output {f['output']:.2e}, input grad {f['input_grad']:.2e}, parameter grad "
                                          f"{f['param_grad']:.2e} (worst {f['worst_param']}; limit {f['limit']:g}){_tp_where(f)}"),
    "tensor_parallel.raised": _tp_raised,
    "fsdp.off": "run with --fsdp N to check the block under FSDP2",
    "fsdp.equal": lambda f: (f"--fsdp {f['ranks']}: per-rank micro-batches give the whole batch's averaged gradients and the same "
                             f"parameters after an SGD step (max relative diff, limit {f['limit']:g})"),
    "fsdp.differs": lambda f: (f"--fsdp {f['ranks']}: differs from one process on the whole batch of {f['batch']}: output "
                               f"{f['output']:.2e}, input grad {f['input_grad']:.2e}, parameter grad {f['param_grad']:.2e} "
                               f"(worst {f['worst_param']}), after a step {f['step']:.2e} (limit {f['limit']:g})"
                               + ("" if f["param_grad"] != float("inf") else
                                  f"; `{f['worst_param']}` gets no gradient under fully_shard: the forward uses a reference "
                                  f"to it kept outside the module (a list, a closure), not the parameter FSDP gathers")),
    "fsdp.raised": lambda f: (f"rank {f['rank']}: " + (f"`{f['where']}` " if f.get("where") else "the forward ")
                              + f"raised under fully_shard: {f['error']}"),
}
