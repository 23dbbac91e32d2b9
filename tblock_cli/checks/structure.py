"""Checks of how the block is built, read from its dataflow: train = eval, norm placement, the FFN's share,
and equality with PyTorch's own layer for the built-in block."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.checks.context import Context, eval_forward
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.probes import rel_diff, train_mode

# The FFN-share check warns when parameters outside attention, FFN and norms exceed this share:
# in a standard block only biases could land there, and they are attributed to their layers.
OTHER_SHARE_MAX = 0.01
# The reference check's tolerance: issue #2's, float32 max |diff| against nn.TransformerEncoderLayer.
REFERENCE_TOL = 1e-5


@contextmanager
def dropout_zeroed(module: nn.Module):
    """Every dropout probability inside set to 0 for a while (modules, MHA's, float attributes named *drop*),
    then restored: the block itself runs, no copy of it (a copy of a 7B-size layer is another 0.8 GB)."""
    saved = []
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
            m.p = 0.0
            continue
        for key, value in list(vars(m).items()):
            if "drop" in key.lower() and isinstance(value, float) and 0 < value < 1:
                saved.append((m, key, value))
                setattr(m, key, 0.0)
    try:
        yield len(saved)
    finally:
        for m, key, value in reversed(saved):
            setattr(m, key, value)


def check_train_eval(ctx: Context) -> Outcome:
    """With every dropout zeroed, a train-mode forward computes what the eval forward does."""
    module = ctx.subject.module
    batch_norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    x = ctx.x()

    def train_forward():
        with train_mode(module, True), torch.no_grad():
            for bn in batch_norms:  # batch statistics are the batch check's business, not this one's
                bn.eval()
            return ctx.subject(x.clone())

    with dropout_zeroed(module):
        a, b = train_forward(), train_forward()
        if rel_diff(a, b) > ctx.tol:
            return skipped("train_eval.random_train")
        ev = eval_forward(ctx, x)
    diff = rel_diff(a, ev)
    if diff > ctx.tol:
        return failed("train_eval.differs", diff, diff=diff)
    return passed("train_eval.agree", diff)


def check_norm_placement(ctx: Context) -> Outcome:
    """A block with norms of its residual stream uses them one way: every sublayer reads a normalised stream
    (Pre-LN), or the stream is normalised after each residual add (Post-LN)."""
    flow = ctx.dataflow()
    if not flow.stream_norms:
        return skipped("norm_placement.no_norms")
    if not flow.attention and not flow.found["ffn"]:
        return skipped("norm_placement.no_sublayers")
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
    other = groups["other"] / flow.total
    if other > OTHER_SHARE_MAX:
        return warned("ffn_share.other", round(share, 4), other=other, **facts)
    return passed("ffn_share.measured", round(share, 4), **facts)


def check_reference(ctx: Context) -> Outcome:
    if not ctx.subject.builtin:
        return skipped("reference.user_block")
    from tblock_cli.reference import reference_output

    x = ctx.x().float()
    # compared in float32; a block already in float32 is used as it is (a copy is another set of weights)
    module = ctx.subject.module if ctx.dtype == torch.float32 else copy.deepcopy(ctx.subject.module).float()
    with train_mode(module, False), torch.no_grad():
        ours = module(x)
        theirs = reference_output(module, ctx.cfg, x)
    diff = (ours - theirs).abs().max().item()
    if not diff <= REFERENCE_TOL:
        return failed("reference.differs", diff, diff=diff, limit=REFERENCE_TOL)
    return passed("reference.equal", diff)
