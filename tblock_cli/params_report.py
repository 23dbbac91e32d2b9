"""Where a block's parameters, bytes and FLOPs are: per component, per group, per run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.anatomy import GROUPS, predicted_ffn_share
from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, reraise_as_measure_error
from tblock_cli.report import Finding, RunInfo, Status, Verdict
from tblock_cli.runtime import dtype_name
from tblock_cli.subject import Subject
from tblock_cli.subject.builtin import Block, Stack
from tblock_cli.subject.kvcache import has_decode

# A backward pass costs two matmuls per forward matmul (one for the input's gradient, one for the
# weight's), so a training step is 3x the forward in matmul FLOPs; FlopCounterMode counts the same.
TRAIN_STEP_FACTOR = 3
# Matrices in the 4 d^2 : 8 d^2 proportion predict exactly 2/3; within this (a twentieth of a percentage
# point, below what the note's one decimal shows) the rule holds and no other matrix ratio is named.
RULE_TOLERANCE = 5e-4


@dataclass(frozen=True)
class Component:
    name: str
    group: str  # attention | ffn | norm | other
    params: int
    bytes: int  # params at the run's dtype
    flops_per_token: int  # forward matmul FLOPs per token, a multiply-add = 2
    grows_with_seq: bool = False  # per-token FLOPs grow with seq, so the run's FLOPs grow with seq^2
    role: str = ""  # attn.q ... attn.out, attn.core (scores + mix), ffn.in / ffn.gate / ffn.out, norm, other
    out_shape: tuple[int, ...] | None = None  # the row's output on the probe input (batch, seq, ...)


@dataclass(frozen=True)
class ParamReport(Verdict):
    subject: str
    components: tuple[Component, ...]  # one layer's rows (+ final_ln), or the user block's module rows
    layers: int  # how many times the per-layer rows repeat in the total
    total: int  # sum(p.numel() for p in module.parameters()): a shared tensor counted once
    total_bytes: int
    groups: dict  # group -> parameters in the whole module
    ffn_share: float | None
    flops: dict  # forward, train_step, forward_seq_quadratic for the whole run
    flops_source: str  # "analytic" or "dataflow trace"
    batch: int
    seq: int
    dtype: str
    run: RunInfo | None = None
    linear_chains: tuple[tuple[str, str], ...] = ()  # FFN (first, second) projections that compose to one linear map
    kv_cache: dict | None = None  # bytes_per_token, bytes_at_seq: what a decoding cache holds
    findings: tuple[Finding, ...] = ()  # the FFN share (or why it is omitted), linear chains

    @property
    def ffn_note(self) -> str:
        """The FFN share finding's sentence (kept in --json as ffn_note)."""
        return next((f.text for f in self.findings if f.kind in FFN_KINDS), "")

    def share(self, params: int) -> float:
        """A parameter count as a fraction of the whole module's."""
        return params / self.total if self.total else 0.0

    def row_share(self, c: Component) -> float:
        """One row's parameters over the whole module, counted once per layer it repeats in."""
        return self.share(c.params * (1 if c.name == "final_ln" else self.layers))

    @property
    def layer_rows(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.name != "final_ln")

    @property
    def one_layer(self) -> Component:
        """The per-layer rows summed: what one layer of the stack holds and computes per token."""
        rows = self.layer_rows
        return Component("one layer", "mixed", sum(c.params for c in rows), sum(c.bytes for c in rows),
                         sum(c.flops_per_token for c in rows))

    def group_bytes(self, group: str) -> int:
        return self.groups[group] * self.total_bytes // self.total if self.total else 0

    @property
    def quadratic_share(self) -> float | None:
        """The part of the forward's FLOPs that grows with seq^2."""
        q, f = self.flops.get("forward_seq_quadratic"), self.flops.get("forward")
        return q / f if q and f else None

    def to_dict(self) -> dict:
        body = {
            "components": [{"name": c.name, "group": c.group, "role": c.role, "params": c.params, "bytes": c.bytes,
                            "flops_per_token": c.flops_per_token, "grows_with_seq": c.grows_with_seq,
                            "out_shape": list(c.out_shape) if c.out_shape else None} for c in self.components],
            "total": self.total, "total_bytes": self.total_bytes, "layers": self.layers, "groups": self.groups,
            "ffn_share": self.ffn_share, "ffn_note": self.ffn_note,
            "linear_chains": [f"{a} -> {b}" for a, b in self.linear_chains],
            "flops": self.flops, "flops_source": self.flops_source, "kv_cache": self.kv_cache, "findings": self.findings,
        }
        return (self.run or RunInfo(self.subject, {}, {})).envelope("params", self.ok, body)


FFN_KINDS = ("params.ffn_share", "params.no_ffn", "params.no_attention")


def _numel(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() for t in tensors if t is not None)


def layer_components(block: Block, batch: int, seq: int, item: int) -> list[Component]:
    """The rows of one built-in block, counted from its own tensors (in_proj split into q, k, v)."""
    d, H = block.attn.embed_dim, block.attn.num_heads
    W, b = block.attn.in_proj_weight, block.attn.in_proj_bias
    fc1, fc2 = block.ffn.fc1, block.ffn.fc2
    tok = (batch, seq, d)

    def row(name, role, params, flops, shape, grows=False):
        return Component(name, role.split(".")[0].replace("attn", "attention"), params, params * item, flops, grows, role, shape)

    rows = [row("ln1", "norm", _numel(block.ln1.weight, block.ln1.bias), 0, tok)]
    for i, name in enumerate(("q", "k", "v")):
        rows.append(row(f"attn.{name}", f"attn.{name}", _numel(W[i * d : (i + 1) * d], None if b is None else b[i * d : (i + 1) * d]),
                        2 * d * d, tok))
    rows += [
        row("attn.scores", "attn.core", 0, 2 * seq * d, (batch, H, seq, seq), True),  # q . k for seq keys, summed over heads
        row("attn.mix", "attn.core", 0, 2 * seq * d, tok, True),  # weights x v
        row("attn.out", "attn.out", _numel(block.attn.out_proj.weight, block.attn.out_proj.bias), 2 * d * d, tok),
        row("ln2", "norm", _numel(block.ln2.weight, block.ln2.bias), 0, tok),
        row("ffn.fc1", "ffn.in", _numel(fc1.weight, fc1.bias), 2 * fc1.in_features * fc1.out_features, (batch, seq, fc1.out_features)),
        row("ffn.fc2", "ffn.out", _numel(fc2.weight, fc2.bias), 2 * fc2.in_features * fc2.out_features, tok),
    ]
    return rows


def builtin_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, run: RunInfo | None = None) -> ParamReport:
    module = subject.module
    item = dtype.itemsize
    blocks = list(module.layers) if isinstance(module, Stack) else [module]
    rows = layer_components(blocks[0], cfg.batch, cfg.seq, item)
    final = getattr(module, "final_ln", None)
    if final is not None:
        rows.append(Component("final_ln", "norm", _numel(final.weight, final.bias), _numel(final.weight, final.bias) * item, 0,
                              role="norm", out_shape=(cfg.batch, cfg.seq, cfg.d_model)))
    per_layer = [r for r in rows if r.name != "final_ln"]
    total = sum(p.numel() for p in module.parameters())
    assert sum(r.params for r in per_layer) * len(blocks) + (rows[-1].params if final is not None else 0) == total
    groups = {g: sum(r.params for r in per_layer if r.group == g) * len(blocks) for g in GROUPS}
    groups["norm"] += rows[-1].params if final is not None else 0
    tokens = cfg.batch * cfg.seq
    forward = tokens * sum(r.flops_per_token for r in per_layer) * len(blocks)
    quadratic = tokens * sum(r.flops_per_token for r in per_layer if r.grows_with_seq) * len(blocks)
    d, f = cfg.d_model, cfg.ffn_dim
    mats = {"ffn": 2 * d * f * len(blocks), "attention": 4 * d * d * len(blocks)}
    share, finding = ffn_share_finding(groups, mats, total, cfg)
    kv = {"bytes_per_token": 2 * len(blocks) * d * item, "bytes_at_seq": 2 * len(blocks) * d * item * cfg.batch * cfg.seq,
          "batch": cfg.batch, "seq": cfg.seq}
    return ParamReport(
        subject.name, tuple(rows), len(blocks), total, total * item, groups, share,
        {"forward": forward, "train_step": TRAIN_STEP_FACTOR * forward, "forward_seq_quadratic": quadratic},
        "analytic", cfg.batch, cfg.seq, dtype_name(dtype), run, (), kv, (finding,),
    )


def ffn_share_of(flow) -> tuple[float | None, Finding]:
    """The FFN's share from the traced roles; omitted, with the reason, when attention or FFN was not found."""
    if not flow.found["attention"]:
        return None, Finding(Status.INFO, "params.no_attention")
    cond = flow.conditioning / flow.total if flow.total else 0.0
    return ffn_share_finding(flow.group_params(), flow.group_params(matrices_only=True), flow.total, None, cond)


def decodes(subject: Subject) -> bool:
    """Causal (--causal, or an hf: decoder), or a decode method on a block that does not say it is bidirectional (an
    hf: encoder's wrapper has the method and causal False)."""
    return subject.causal or (has_decode(subject.module) and getattr(subject.module, "causal", None) is not False)


def kv_cache_bytes(cfg: BlockConfig, dtype: torch.dtype, flow) -> dict | None:
    """What a decoding cache holds: the keys and values every attention call keeps, per token and at --seq. Only for
    a block that decodes (causal, or with a decode method): an encoder (bert, vit) keeps no cache."""
    if not flow.attention:
        return None
    item = dtype.itemsize
    per_token = sum(c.kv_width for c in flow.attention) * item
    return {"bytes_per_token": per_token, "bytes_at_seq": per_token * cfg.batch * cfg.seq, "batch": cfg.batch, "seq": cfg.seq}


def ffn_share_finding(groups: dict, mats: dict, total: int, cfg: BlockConfig | None,
                      cond: float = 0.0) -> tuple[float | None, Finding]:
    """The FFN's share and what moves it off the 2/3 rule: a d_ff other than 4 d_model, other matrix sizes, biases and
    norms, and conditioning (cond: the share of projections that read no input, adaLN's)."""
    if not groups.get("ffn") or not total:
        return None, Finding(Status.INFO, "params.no_ffn")
    share = groups["ffn"] / total
    predicted = predicted_ffn_share(mats)
    d_ff_ratio = cfg.ffn_dim / cfg.d_model if cfg is not None and cfg.ffn_dim != 4 * cfg.d_model else None
    off_rule = d_ff_ratio is None and abs(predicted - 2 / 3) > RULE_TOLERANCE
    return share, Finding(Status.INFO, "params.ffn_share", {
        "share": share, "predicted": predicted, "d_ff_ratio": d_ff_ratio,
        "matrix_ratio": mats["ffn"] / mats["attention"] if off_rule and mats["attention"] else None,
        "no_attention_matrix": off_rule and not mats["attention"], "cond": cond})


def user_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, tree_depth: int | None = None,
                run: RunInfo | None = None) -> ParamReport:
    """Rows by dataflow role (one traced forward), or by the module tree down to tree_depth; FLOPs from the trace."""
    from tblock_cli.anatomy import trace

    module = subject.module
    item = dtype.itemsize
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=torch.Generator().manual_seed(cfg.seed)).to(
        device=next(module.parameters(), torch.empty(0)).device, dtype=dtype)
    try:
        flow = trace(module, subject, x, cfg.d_model)
    except USER_ERRORS as e:  # the block under test raised (sys.exit included)
        reraise_as_measure_error(e, f"{subject.name} raised while its dataflow was traced")
    tokens = flow.tokens
    if tree_depth is None:
        rows = [Component(m.name, m.group, m.params, m.params * item, m.flops // tokens, role=m.role, out_shape=m.out_shape)
                for m in flow.modules]
        for i, c in enumerate(flow.attention):
            where = c.where or "(root)"
            rows.append(Component(f"{where}: scores+mix" + (f" #{i}" if len(flow.attention) > 1 else ""), "attention", 0, 0,
                                  c.flops // tokens, True, role="attn.core", out_shape=(c.batch, c.heads, c.q_len, c.k_len)))
    else:
        rows = tree_rows(module, flow, tree_depth, item)
    total = flow.total
    assert sum(r.params for r in rows) == total
    groups = flow.group_params()
    forward = sum(m.flops for m in flow.modules) + sum(c.flops for c in flow.attention)
    quadratic = sum(c.flops for c in flow.attention)
    share, finding = ffn_share_of(flow)
    chains = tuple((a, b) for a, b in flow.linear_chains)
    findings = (finding, *(Finding(Status.WARN, "params.linear_chain", {"first": a, "second": b}) for a, b in chains))
    return ParamReport(
        subject.name, tuple(rows), 1, total, total * item, groups, share,
        {"forward": forward, "train_step": TRAIN_STEP_FACTOR * forward, "forward_seq_quadratic": quadratic},
        "dataflow trace", cfg.batch, cfg.seq, dtype_name(dtype), run,
        chains, kv_cache_bytes(cfg, dtype, flow) if decodes(subject) else None, findings,
    )


def tree_rows(module: nn.Module, flow, tree_depth: int, item: int) -> list[Component]:
    """The module tree cut at tree_depth: a row per module there (everything under it), and an '(own)' row for
    what a module above the cut holds or runs itself. Every FLOP lands on the module that ran it; none is negative."""
    rows: list[Component] = []
    seen: set[int] = set()
    uses, calls = list(flow.modules), list(flow.attention)

    def under(name: str, prefix: str) -> bool:
        return not prefix or name == prefix or name.startswith(prefix + ".")

    def emit(label: str, params: list, prefix: str):
        nonlocal uses, calls
        mine = [u for u in uses if under(u.name, prefix)]
        ran = [c for c in calls if under(c.where, prefix)]
        uses = [u for u in uses if u not in mine]
        calls = [c for c in calls if c not in ran]
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        n, flops = sum(p.numel() for p in fresh), sum(u.flops for u in mine) + sum(c.flops for c in ran)
        if not n and not flops:
            return
        groups = {u.group for u in mine} | ({"attention"} if ran else set())
        group = groups.pop() if len(groups) == 1 else ("mixed" if groups else "other")
        rows.append(Component(label, group, n, n * item, flops // flow.tokens, bool(ran)))

    def visit(prefix: str, m: nn.Module, level: int):
        children = list(m.named_children())
        if level < tree_depth and children:
            for cname, child in children:
                visit(f"{prefix}.{cname}" if prefix else cname, child, level + 1)
            emit(f"{prefix} (own)" if prefix else "(root, own)", list(m.parameters(recurse=False)), prefix)
        else:
            emit(prefix or "(root)", list(m.parameters()), prefix)

    visit("", module, 0)
    return rows


def param_report(subject: Subject, cfg: BlockConfig, dtype: torch.dtype, tree_depth: int | None = None,
                 run: RunInfo | None = None) -> ParamReport:
    if subject.builtin and tree_depth is None:
        return builtin_report(subject, cfg, dtype, run)
    return user_report(subject, cfg, dtype, tree_depth, run)
