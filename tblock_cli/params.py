"""Where a block's parameters, bytes and FLOPs are: per component, per group, per run."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli import anatomy
from tblock_cli.block import Block, Stack
from tblock_cli.config import BlockConfig
from tblock_cli.errors import reraise_as_measure_error
from tblock_cli.loading import Subject

# A backward pass costs two matmuls per forward matmul (one for the input's gradient, one for the
# weight's), so a training step is 3x the forward in matmul FLOPs; FlopCounterMode counts the same.
TRAIN_STEP_FACTOR = 3


@dataclass(frozen=True)
class Component:
    name: str
    group: str  # attention | ffn | norm | other
    params: int
    bytes: int  # params at the run's dtype
    flops_per_token: int  # forward matmul FLOPs per token, a multiply-add = 2
    grows_with_seq: bool = False  # per-token FLOPs grow with seq, so the run's FLOPs grow with seq^2


@dataclass(frozen=True)
class ParamReport:
    subject: str
    components: tuple[Component, ...]  # one layer's rows (+ final_ln), or the user block's module rows
    layers: int  # how many times the per-layer rows repeat in the total
    total: int  # sum(p.numel() for p in module.parameters()): a shared tensor counted once
    total_bytes: int
    groups: dict  # group -> parameters in the whole module
    ffn_share: float | None
    ffn_note: str
    flops: dict  # forward, train_step, forward_seq_quadratic for the whole run
    flops_source: str  # "analytic" or "FlopCounterMode"
    batch: int
    seq: int
    dtype: str


def _numel(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() for t in tensors if t is not None)


def layer_components(block: Block, seq: int, item: int) -> list[Component]:
    """The rows of one built-in block, counted from its own tensors (in_proj split into q, k, v)."""
    d = block.attn.embed_dim
    W, b = block.attn.in_proj_weight, block.attn.in_proj_bias
    fc1, fc2 = block.ffn.fc1, block.ffn.fc2

    def row(name, group, params, flops, grows=False):
        return Component(name, group, params, params * item, flops, grows)

    rows = [row("ln1", "norm", _numel(block.ln1.weight, block.ln1.bias), 0)]
    for i, name in enumerate(("q", "k", "v")):
        rows.append(row(f"attn.{name}", "attention", _numel(W[i * d : (i + 1) * d], None if b is None else b[i * d : (i + 1) * d]), 2 * d * d))
    rows += [
        row("attn.scores", "attention", 0, 2 * seq * d, True),  # q . k for seq keys, summed over heads
        row("attn.mix", "attention", 0, 2 * seq * d, True),  # weights x v
        row("attn.out", "attention", _numel(block.attn.out_proj.weight, block.attn.out_proj.bias), 2 * d * d),
        row("ln2", "norm", _numel(block.ln2.weight, block.ln2.bias), 0),
        row("ffn.fc1", "ffn", _numel(fc1.weight, fc1.bias), 2 * fc1.in_features * fc1.out_features),
        row("ffn.fc2", "ffn", _numel(fc2.weight, fc2.bias), 2 * fc2.in_features * fc2.out_features),
    ]
    return rows


def builtin_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype) -> ParamReport:
    module = subject.module
    item = torch.empty((), dtype=dtype).element_size()
    blocks = list(module.layers) if isinstance(module, Stack) else [module]
    rows = layer_components(blocks[0], cfg.seq, item)
    final = getattr(module, "final_ln", None)
    if final is not None:
        rows.append(Component("final_ln", "norm", _numel(final.weight, final.bias), _numel(final.weight, final.bias) * item, 0))
    per_layer = [r for r in rows if r.name != "final_ln"]
    total = sum(p.numel() for p in module.parameters())
    assert sum(r.params for r in per_layer) * len(blocks) + (rows[-1].params if final is not None else 0) == total
    groups = {g: sum(r.params for r in per_layer if r.group == g) * len(blocks) for g in anatomy.GROUPS}
    groups["norm"] += rows[-1].params if final is not None else 0
    tokens = cfg.batch * cfg.seq
    forward = tokens * sum(r.flops_per_token for r in per_layer) * len(blocks)
    quadratic = tokens * sum(r.flops_per_token for r in per_layer if r.grows_with_seq) * len(blocks)
    share, note = ffn_share_note(module, groups, total, cfg)
    return ParamReport(
        subject.name, tuple(rows), len(blocks), total, total * item, groups, share, note,
        {"forward": forward, "train_step": TRAIN_STEP_FACTOR * forward, "forward_seq_quadratic": quadratic},
        "analytic", cfg.batch, cfg.seq, str(dtype).replace("torch.", ""),
    )


def ffn_share_note(module: nn.Module, groups: dict, total: int, cfg: BlockConfig | None) -> tuple[float | None, str]:
    """The FFN's share and a sentence on why it differs from 2/3, when it does."""
    if not groups.get("ffn") or not total:
        return None, "no FFN recognised (Linear -> activation -> Linear outside attention): FFN share omitted"
    share = groups["ffn"] / total
    mats = anatomy.matrix_counts(module)
    predicted = anatomy.predicted_ffn_share(mats)
    reasons = []
    if cfg is not None and cfg.ffn_dim != 4 * cfg.d_model:
        r = cfg.ffn_dim / cfg.d_model
        reasons.append(f"d_ff = {r:g} x d_model, not 4: the matrices predict 2r/(4+2r) = {predicted:.1%}")
    elif abs(predicted - 2 / 3) > 5e-4:
        reasons.append(f"FFN matrices are {mats['ffn'] / max(1, mats['attention']):.2f}x the attention's, not 2x: they predict {predicted:.1%}")
    extra = share - predicted
    if abs(extra) >= 5e-4:
        reasons.append(f"biases and norms move it {extra * 100:+.1f} points")
    why = "; ".join(reasons) if reasons else "as the rule says (biases and norms move it by less than 0.05 points)"
    return share, f"FFN holds {share:.1%} of the parameters, against the 2/3 rule's 66.7%: {why}"


@contextmanager
def countable_attention():
    """Grad-enabled math attention with the MHA fast path off: every matmul visible to FlopCounterMode."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def counted_flops(subject: Subject, x: torch.Tensor) -> tuple[dict[str, int], int, int]:
    """FlopCounterMode over one forward (per-module counts) and one forward+backward (total).

    Module attribution is taken from the forward alone: in backward, FlopCounterMode's module
    tracking is not reliable (seen on torch 2.13: gradient matmuls credited to the wrong module).
    """
    from torch.utils.flop_counter import FlopCounterMode

    was = subject.module.training
    subject.module.eval()  # no dropout; the fast path is off, so eval still takes the counted path
    try:
        with countable_attention():
            with FlopCounterMode(display=False) as fwd:
                out = subject(x)
            per_module = {k: int(sum(v.values())) for k, v in fwd.get_flop_counts().items()}
            with FlopCounterMode(display=False) as step:
                out = subject(x.detach().clone().requires_grad_(True))
                out.backward(torch.ones_like(out))
        subject.module.zero_grad(set_to_none=True)
    finally:
        subject.module.train(was)
    return per_module, int(fwd.get_total_flops()), int(step.get_total_flops())


def user_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, depth: int = 1) -> ParamReport:
    """Rows from the module tree (children to `depth`), FLOPs from FlopCounterMode."""
    module = subject.module
    item = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=torch.Generator().manual_seed(cfg.seed)).to(
        device=next(module.parameters(), torch.empty(0)).device, dtype=dtype)
    try:
        per_module, forward, step = counted_flops(subject, x)
    except Exception as e:  # noqa: BLE001 - the block under test raised
        reraise_as_measure_error(e, f"{subject.name} raised while its FLOPs were counted")
    root_key = type(module).__name__
    groups_of = anatomy.classify(module)
    tokens = cfg.batch * cfg.seq
    seen: set[int] = set()
    rows: list[Component] = []

    def flops_of(qualname: str) -> int:
        return per_module.get(f"{root_key}.{qualname}" if qualname else root_key, 0)

    def add(qualname: str, mod: nn.Module, level: int):
        children = list(mod.named_children())
        if level < depth and children:
            for cname, child in children:
                add(f"{qualname}.{cname}" if qualname else cname, child, level + 1)
            own = [(n, p) for n, p in mod.named_parameters(recurse=False)]
            child_flops = sum(flops_of(f"{qualname}.{c}" if qualname else c) for c, _ in children)
            inside = {groups_of[f"{qualname}.{n}" if qualname else n] for n, _ in mod.named_parameters()}
            add_row(f"{qualname}.(own)" if qualname else "(own)", [(f"{qualname}.{n}" if qualname else n, p) for n, p in own],
                    flops_of(qualname) - child_flops, inside.pop() if len(inside) == 1 else "other")
        else:
            named = [(f"{qualname}.{n}" if qualname else n, p) for n, p in mod.named_parameters()]
            add_row(qualname, named, flops_of(qualname))

    def add_row(name: str, named: list, flops: int, fallback: str = "other"):
        fresh = [(n, p) for n, p in named if id(p) not in seen]
        seen.update(id(p) for _, p in fresh)
        params = sum(p.numel() for _, p in fresh)
        if not params and not flops:
            return
        groups = {groups_of.get(n, "other") for n, _ in fresh}
        group = groups.pop() if len(groups) == 1 else ("mixed" if groups else fallback)
        rows.append(Component(name, group, params, params * item, round(flops / tokens)))

    add("", module, 0)
    total = sum(p.numel() for p in module.parameters())
    assert sum(r.params for r in rows) == total
    groups = anatomy.group_counts(module)
    share, note = ffn_share_note(module, groups, total, None)
    return ParamReport(
        subject.name, tuple(rows), 1, total, total * item, groups, share, note,
        {"forward": forward, "train_step": step, "forward_seq_quadratic": None},
        "FlopCounterMode", cfg.batch, cfg.seq, str(dtype).replace("torch.", ""),
    )


def param_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, depth: int = 1) -> ParamReport:
    if subject.builtin:
        return builtin_report(subject, cfg, dtype)
    return user_report(subject, cfg, dtype, depth)
