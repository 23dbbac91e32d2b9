"""Checks of how the block is built, read from its dataflow: train = eval, norm placement, the FFN's share,
and equality with PyTorch's own layer for the built-in block."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.anatomy.dataflow import OTHER_SHARE_MAX
from tblock_cli.checks.context import Context, eval_forward
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import cast, grads_kept, module_copy, raise_dropout, rel_diff, train_mode, zero_dropout  # noqa: F401 - raise_dropout: part of this room's vocabulary

# The reference check's tolerance, max |diff| against nn.TransformerEncoderLayer: issue #2's 1e-5 in float32, where
# float32 is all the device has (MPS). Elsewhere both run in float64 (to 1e-9): a CUDA device's float32 kernels differ
# by 1e-4 between two correct paths (measured on an H100: the fused attention of one against the other's), which says
# nothing of the block.
REFERENCE_TOL = {torch.float32: 1e-5, torch.float64: 1e-9}


def rebuilt_with_dropout(ctx: Context, p: float) -> nn.Module | None:
    """The user's block built again through its constructor with dropout=p (its --kwargs kept; at 0: a functional
    dropout reading a plain attribute cannot be zeroed from outside), holding the original's weights; None where that
    is not possible (the built-in block, an hf: layer, a block built at dropout 0 or taking no dropout, one handed
    over built)."""
    from tblock_cli.subject.loading import ALIASES, constructor_kwargs, load_factory

    spec, rebuild = ctx.subject.name, ctx.subject.rebuild
    if ctx.subject.builtin or spec.startswith("hf:") or not ctx.cfg.dropout or rebuild is None:
        return None
    try:
        named, _ = constructor_kwargs(load_factory(spec), ctx.cfg)
        if not set(named) & set(ALIASES["dropout"]):
            return None
        module = rebuild(ctx.cfg.seed, "cpu", dropout=p)
        module.load_state_dict(ctx.subject.module.state_dict())
        return cast(module, ctx.dtype, ctx.device)
    except Exception:  # noqa: BLE001 - any failure: fall back to zeroing the copy's dropout
        return None


def eval_unused(ctx: Context, x: torch.Tensor) -> tuple[list[str], torch.Tensor | None]:
    """Parameters a train-mode backward reaches that an eval-mode graph never reaches (an eval-only path), read from
    the eval forward's graph; and that forward's output."""
    from tblock_cli.checks.gradients import train_backward
    from tblock_cli.checks.graphs import graph_nodes
    from tblock_cli.checks.paths import reached_parameters

    _, train = train_backward(ctx)
    params = [(n, p) for n, p in ctx.subject.module.named_parameters() if p.requires_grad and train.get(n) is not None]
    with train_mode(ctx.subject.module, False), torch.enable_grad():
        out = ctx.subject(x.clone())
    if not params:
        return [], out.detach()
    reached = reached_parameters(out) if out.requires_grad else set()
    unused = [n for n, p in params if id(p) not in reached]
    if unused and out.requires_grad:  # a path the data chooses (an expert) that dropout's draws moved in training: a
        with train_mode(ctx.subject.module, True), zero_dropout(ctx.subject.module), torch.enable_grad():  # train
            still = reached_parameters(ctx.subject(x.clone()))  # forward without them reaches what eval does
        unused = [n for n, p in params if id(p) not in reached and id(p) in still]
    if unused and (not out.requires_grad or any(n.name() == "CheckpointFunctionBackward" for n in graph_nodes(out.grad_fn))):
        # a reentrant checkpoint hides its parameters from the graph (and gives no graph where no input requires
        # grad): a real eval backward from an input that requires grad tells what it reaches
        module, xin = ctx.subject.module, x.clone().requires_grad_(True)
        with train_mode(module, False), torch.enable_grad(), grads_kept(module):
            ctx.subject(xin).float().sum().backward()
            unused = [n for n, p in params if p.grad is None]
    return unused, out.detach()


def check_train_eval(ctx: Context) -> Outcome:
    """With every dropout zeroed, a train-mode forward computes what the eval forward does.

    Catches: parameters a train backward reaches that an eval backward never touches (not where a train forward with
    dropout zeroed leaves them too: a path the data chooses, an expert, that dropout's draws moved); with every dropout zeroed (the
    block rebuilt through its constructor with `dropout=0` where it takes one), a train-mode forward that differs
    from the eval forward (an eval-only path), unless a second train forward shows training itself random"""
    x = ctx.x()
    try:
        unused, ev = eval_unused(ctx, x)
    except Exception:  # noqa: BLE001 - a forward that raises is the other checks' business; compare forwards alone
        unused, ev = [], None
    if unused:
        return failed("train_eval.eval_unused", len(unused), params=unused)
    rebuilt = rebuilt_with_dropout(ctx, 0.0)
    module = rebuilt if rebuilt is not None else ctx.subject.module
    twin = ctx.subject.like(module)
    batch_norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def train_forward():
        with train_mode(module, True), torch.no_grad():
            for bn in batch_norms:  # batch statistics are the batch check's business, not this one's
                bn.eval()
            return twin(x.clone())

    with zero_dropout(module):  # in place where not rebuilt, put back after: no copy of the weights
        a = train_forward()
        if rebuilt is not None or ev is None:
            ev = eval_forward(ctx, x, subject=twin)
        diff = rel_diff(a, ev)
        # Only a train forward that differs is run again: one random with dropout zeroed (noise, stochastic depth) is
        # not this check's to judge, and a forward that equals the eval one has nothing left to explain.
        if diff > ctx.tol and rel_diff(a, train_forward()) > ctx.tol:
            return skipped("train_eval.random_train")
    if diff > ctx.tol:
        return failed("train_eval.differs", diff, diff=diff, rebuilt=rebuilt is not None)
    return passed("train_eval.agree", diff, rebuilt=rebuilt is not None)


def shared_norms(module, norms) -> list[list[str]]:
    """Stream norms with parameters registered under more than one name (`self.ln2 = self.ln1`): one set of gains for
    two places where the block means two."""
    names: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    mods = dict(module.named_modules(remove_duplicate=False))
    shared = {id(mods[n]): names[id(mods[n])] for n in norms if n in mods and len(names[id(mods[n])]) > 1
              and any(True for _ in mods[n].parameters())}
    return list(shared.values())


def check_norm_placement(ctx: Context) -> Outcome:
    """A block with norms of its residual stream uses them one way: every sublayer reads a normalised stream
    (Pre-LN), or the stream is normalised after each residual add (Post-LN).

    Catches: in a block with norms of its residual stream: an FFN that reads the stream with no norm before it,
    attention that does while no norm follows the add (a missing norm, or Pre- and Post-LN mixed in one block),
    keys/values that skip the norm the queries get, one norm module registered under two names (`self.ln2 = self.ln1`:
    one set of gains for both sublayers): **warnings**; every sublayer reading the raw stream with its output
    normalised before the add (OLMo-2's placement) passes"""
    flow = ctx.dataflow()
    if not flow.stream_norms:
        return skipped("norm_placement.no_norms")
    if not flow.attention and not flow.found["ffn"]:
        return skipped("norm_placement.no_sublayers")
    shared = shared_norms(ctx.subject.module, [n for n, w in flow.norms.items() if w == ctx.cfg.d_model])
    if shared:
        return warned("norm_placement.shared", ", ".join(" = ".join(g) for g in shared), shared=shared)
    if flow.sublayer_post and not flow.split_kv:
        return passed("norm_placement.sublayer_post")
    if flow.unnormed_ffn:
        return warned("norm_placement.ffn_unnormed", ", ".join(flow.unnormed_ffn), modules=list(flow.unnormed_ffn))
    if flow.split_kv:
        return warned("norm_placement.split_kv", ", ".join(flow.split_kv), modules=list(flow.split_kv))
    if flow.unnormed_attention and not flow.output_normed:
        return warned("norm_placement.attention_unnormed", ", ".join(flow.unnormed_attention),
                      modules=list(flow.unnormed_attention))
    if flow.output_normed and flow.unnormed_attention:
        return passed("norm_placement.post")
    return passed("norm_placement.pre")


def check_ffn_share(ctx: Context) -> Outcome:
    """Catches: the FFN's share from dataflow roles against what its matrices predict; **warns** on a linear FFN (two
    projections with no nonlinearity); says how much sits outside attention, FFN and norms where that is over 1 % (a
    residual's GRU gates, adaLN's tables, hyper-connections, a position table: designs, so a pass that says where the
    parameters are, not a warning)"""
    from tblock_cli.anatomy import predicted_ffn_share

    flow = ctx.dataflow()
    if not flow.found["ffn"]:
        return skipped("ffn_share.no_ffn")
    if not flow.found["attention"]:
        return skipped("ffn_share.no_attention")
    groups, mats = flow.group_params(), flow.group_params(matrices_only=True)
    share = groups["ffn"] / flow.total
    predicted = predicted_ffn_share(mats)
    facts = {"share": share, "predicted": predicted, "matrix_ratio": mats["ffn"] / mats["attention"] if mats["attention"] else None}
    if flow.linear_chains:
        return warned("ffn_share.linear", round(share, 4), chains=[list(c) for c in flow.linear_chains], **facts)
    other = flow.stray / flow.total
    if other > OTHER_SHARE_MAX:  # parameters added to the scores or put beside the keys are attention's
        scoring = _scoring(ctx, flow)
        facts["scoring"] = sorted(scoring)
        other = (flow.stray - sum(scoring.values())) / flow.total
    if other > OTHER_SHARE_MAX:
        return passed("ffn_share.other", round(share, 4), other=other, **facts)
    return passed("ffn_share.measured", round(share, 4), **facts)


def _scoring(ctx: Context, flow) -> dict[str, int]:
    """Parameters of the dataflow's `other` rows that reach what attention is computed from, a softmax's input (a
    relative-position bias table the block itself holds, added to the scores) or sdpa's mask, keys and values (learned
    memory slots concatenated to them), and no input of a projection run before attention (a position table added to
    the stream reaches attention through the q, k, v projections). name -> elements. One forward and two backwards, only where
    `other` is large."""
    from torch.overrides import TorchFunctionMode

    module = ctx.subject.module
    params = dict(module.named_parameters())
    mods = dict(module.named_modules())
    rows = {}
    for m in flow.modules:
        if m.group != "other":
            continue
        name = "" if m.name == "(root)" else m.name
        if name in params:
            rows[name] = params[name]
        elif name in mods:
            rows.update({(f"{name}.{k}" if name else k): q for k, q in mods[name].named_parameters(recurse=False)})
    rows = {n: q for n, q in rows.items() if q.requires_grad}
    seen: list[torch.Tensor] = []
    projected: list[torch.Tensor] = []

    class Inputs(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax) and args:
                seen.append(args[0])
            elif func is torch.nn.functional.linear and args and not seen:  # the projections before attention
                projected.append(args[0])
            elif func is torch.nn.functional.scaled_dot_product_attention:
                seen.extend(t for t in (*args[1:4], kwargs.get("attn_mask"), kwargs.get("key"), kwargs.get("value"))
                            if isinstance(t, torch.Tensor) and t.is_floating_point())
            return func(*args, **kwargs)

    if not rows:
        return {}
    gen = torch.Generator().manual_seed(0)
    try:
        with train_mode(module, False), torch.enable_grad(), Inputs():
            ctx.subject(ctx.standard()[0].clone())
        reached = []
        for ts in (seen, projected):
            live = [t for t in ts if t.requires_grad]
            loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in live) if live else None
            grads = torch.autograd.grad(loss, list(rows.values()), allow_unused=True, retain_graph=True) if live else ()
            reached.append({n for (n, _), g in zip(rows.items(), grads) if g is not None and bool(g.any())})
    except Exception as e:  # noqa: BLE001 - a block this cannot run: its parameters stay where the dataflow put them
        from tblock_cli.errors import is_out_of_memory

        if is_out_of_memory(e):
            raise
        return {}
    return {n: q.numel() for n, q in rows.items() if n in reached[0] and n not in reached[1]}


def check_reference(ctx: Context) -> Outcome:
    """Catches: the built-in block against `nn.TransformerEncoderLayer` with copied weights (1e-9 in float64; 1e-5 in
    float32 on MPS, which has no float64)"""
    if not ctx.subject.builtin:
        return skipped("reference.user_block")
    from tblock_cli.subject.reference import reference_output

    dtype = torch.float32 if ctx.device.type == "mps" else torch.float64
    x = ctx.x().to(dtype)
    module = module_copy(ctx.subject.module).to(dtype)
    with train_mode(module, False), torch.no_grad():
        ours = ctx.subject.like(module)(x)
        theirs = reference_output(module, ctx.cfg, x)
    diff = (ours - theirs).abs().max().item()
    where = str(dtype).removeprefix("torch.")
    if not diff <= REFERENCE_TOL[dtype]:
        return failed("reference.differs", diff, diff=diff, limit=REFERENCE_TOL[dtype], dtype=where)
    return passed("reference.equal", diff, dtype=where)
