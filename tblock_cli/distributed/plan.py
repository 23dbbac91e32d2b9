"""The tensor-parallel plan: module name -> colwise / rowwise / replicate, derived from dataflow roles or read from a file.

Megatron's split: the projections that fan out of the stream (q, k, v, FFN in and gate) are split by
output features (`ColwiseParallel`), each rank keeping whole heads and a slice of the FFN hidden
units; the projections that fan back in (attention out, FFN out) are split by input features
(`RowwiseParallel`) and all-reduced. Norms and everything else stay replicated. What PyTorch's
engine cannot shard this way is refused with the reason, never run into a false verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tblock_cli.errors import ConfigError

STYLES = ("colwise", "rowwise", "replicate")
COLWISE_ROLES = ("attn.q", "attn.k", "attn.v", "ffn.in", "ffn.gate")
ROWWISE_ROLES = ("attn.out", "ffn.out")
FUSED_ROLES = ("attn.qkv", "attn.qk", "attn.kv")
THROUGH_NORM = "attn.q/k (via a norm)"  # the role shown for a query/key projection found beside its value projection
SHARDABLE = (nn.Linear, nn.Embedding)  # what ColwiseParallel / RowwiseParallel accept


@dataclass(frozen=True)
class Plan:
    """What each module becomes under tensor parallelism, and the role the dataflow gave it."""

    styles: dict  # module name -> colwise / rowwise (replicated modules are left out: that is the default)
    roles: dict  # module name -> dataflow role (attn.q, ffn.out, norm, ...), for every module with parameters
    source: str  # "derived" or the plan file

    def rows(self) -> list[tuple[str, str, str]]:
        """(module, role, style) for every module with parameters, sharded or replicated."""
        names = list(dict.fromkeys([*self.roles, *self.styles]))
        return [(n, self.roles.get(n, ""), self.styles.get(n, "replicate")) for n in names]

    def to_dict(self) -> dict:
        return {"source": self.source, "modules": [{"module": m, "role": r, "style": s} for m, r, s in self.rows()]}


def derive(module: nn.Module, dataflow, n: int, n_heads: int, d_model: int) -> Plan:
    """The Megatron plan from the traced roles; ConfigError naming what cannot be sharded and how to fix it."""
    mha = next((name for name, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)), None)
    if mha is not None:
        raise ConfigError(f"--tp: `{mha or type(module).__name__}` is nn.MultiheadAttention, which PyTorch tensor "
                          f"parallelism does not shard (q, k and v share one in_proj_weight inside a fused kernel); "
                          f"write attention with separate q/k/v/out nn.Linear layers, or check data parallelism with --fsdp")
    roles = {m.name: m.role for m in dataflow.modules}
    fused = sorted(n_ for n_, r in roles.items() if r in FUSED_ROLES)
    if fused:
        name = fused[0]
        what = roles[name].split(".")[1]
        listed = ", ".join(what[:-1]) + " and " + what[-1]
        kind = type(dict(module.named_modules()).get(name)).__name__
        fix = ("" if kind == "Linear" else f" (a {kind}: ColwiseParallel takes nn.Linear)") + \
            ("" if kind != "Linear" else ", or shard by hand with --tp-plan")
        raise ConfigError(f"--tp: `{name}` computes {listed} in one matrix ({roles[name]}); column-sharding it "
                          f"would give each rank a slice of [{'|'.join(what)}], not of each: split it into separate "
                          f"{', '.join(what)} nn.Linear layers (d_model -> d_model each){fix}")
    styles = {}
    for name, role in roles.items():
        style = "colwise" if role in COLWISE_ROLES else "rowwise" if role in ROWWISE_ROLES else None
        if style is not None:
            styles[name] = style
    for name in through_norm(module, dataflow, roles):
        styles[name], roles[name] = "colwise", THROUGH_NORM
    if not any(s == "colwise" for s in styles.values()) or not any(s == "rowwise" for s in styles.values()):
        raise ConfigError("--tp: the dataflow shows no projection pair to shard (q/k/v or FFN in, then an output "
                          "projection); give the plan with --tp-plan FILE")
    plan = Plan(styles, roles, "derived")
    validate(module, plan, n, n_heads, d_model)
    return plan


def through_norm(module: nn.Module, dataflow, roles: dict) -> list[str]:
    """Query/key projections the dataflow lost: a norm over their full width (OLMo-2's QK-norm) starts a new
    provenance, as a norm of the stream does, so the attention shows values but no queries or keys. Taken as
    such: the nn.Linear layers with no role beside a value projection (same parent, same input width)."""
    names = dict(module.named_modules())
    found = []
    for call in dataflow.attention:
        if call.q and call.k:
            continue
        for v in call.v:
            parent, vm = v.rpartition(".")[0], names.get(v)
            if not isinstance(vm, nn.Linear):
                continue
            found += [n for n, m in names.items() if isinstance(m, nn.Linear) and roles.get(n) == "other"
                      and n.rpartition(".")[0] == parent and m.in_features == vm.in_features and n not in found]
    return found


def load(path: str, module: nn.Module, dataflow, n: int, n_heads: int, d_model: int) -> Plan:
    """A JSON object module name -> colwise / rowwise / replicate, checked against the block."""
    from tblock_cli.report import read_json

    raw = read_json(path, "--tp-plan", 'an object like {"q_proj": "colwise", "o_proj": "rowwise"}')
    if not isinstance(raw, dict) or not all(isinstance(k, str) and v in STYLES for k, v in raw.items()):
        raise ConfigError(f"--tp-plan {path}: expected a JSON object module name -> one of {', '.join(STYLES)}")
    names = dict(module.named_modules())
    unknown = sorted(k for k in raw if k not in names)
    if unknown:
        raise ConfigError(f"--tp-plan {path}: no module named {', '.join(unknown)} in the block "
                          f"(its modules: {', '.join(n_ for n_ in names if n_)[:300]})")
    sharded = {k: v for k, v in raw.items() if v != "replicate"}
    if not sharded:  # every rank would hold the whole block: the check would compare the block with itself
        raise ConfigError(f"--tp-plan {path}: the plan shards no module (it is empty or all replicate), so it checks "
                          f"nothing; name at least one colwise or rowwise module, or drop --tp-plan for the derived plan")
    roles = {m.name: m.role for m in dataflow.modules}
    plan = Plan(sharded, roles, path)
    validate(module, plan, n, n_heads, d_model)
    return plan


def validate(module: nn.Module, plan: Plan, n: int, n_heads: int, d_model: int) -> None:
    """Every sharded module is one PyTorch can shard, and every split width divides by n."""
    if n_heads % n:
        raise ConfigError(f"--tp {n}: {n_heads} attention heads do not split evenly over {n} ranks; "
                          f"use a rank count that divides the head count")
    names = dict(module.named_modules())
    for name, style in plan.styles.items():
        m = names.get(name)
        if m is None:
            raise ConfigError(f"--tp: `{name}` is a bare parameter, not a module; PyTorch tensor parallelism shards "
                              f"nn.Linear and nn.Embedding modules: write the projection as nn.Linear")
        if not isinstance(m, SHARDABLE):
            raise ConfigError(f"--tp: `{name}` ({plan.roles.get(name, 'unknown role')}) is a {type(m).__name__}; "
                              f"{'Colwise' if style == 'colwise' else 'Rowwise'}Parallel shards nn.Linear and "
                              f"nn.Embedding: write it as nn.Linear (GPT-2's Conv1D holds the transposed weight)")
        width, what = _split_width(m, style)
        if width % n:
            raise ConfigError(f"--tp {n}: `{name}` splits its {what} ({width}) over {n} ranks, and {width} is not "
                              f"divisible by {n}; use a rank count that divides it")
        head_dim = d_model // n_heads
        if plan.roles.get(name) in ("attn.k", "attn.v") and style == "colwise" and width // head_dim % n:
            raise ConfigError(f"--tp {n}: `{name}` has {width // head_dim} head(s) of {head_dim}, which do not split over "
                              f"{n} ranks without cutting a head (grouped-query attention: the key/value heads must be "
                              f"divisible by the rank count){kv_heads_hint(module, n)}")


def kv_heads_hint(module: nn.Module, n: int) -> str:
    """Where the key/value head count is a config field (an hf: layer, which tblock sizes in the family's proportion
    of query to key/value heads), the field that gives more."""
    config = getattr(module, "config", None)
    field = next((f for f in ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
                  if isinstance(getattr(config, f, None), int)), None)
    return f"; give more with --kwargs '{{\"{field}\": {n}}}' (or a multiple of {n})" if field else ""


def _split_width(m: nn.Module, style: str) -> tuple[int, str]:
    if isinstance(m, nn.Embedding):
        return (m.embedding_dim, "embedding dimension") if style == "colwise" else (m.num_embeddings, "vocabulary")
    return (m.out_features, "output features") if style == "colwise" else (m.in_features, "input features")


def plan_for(subject, cfg, device: torch.device, dtype: torch.dtype, n: int, path: str | None) -> Plan:
    """The plan for this block: traced once on a probe input, derived or read from --tp-plan."""
    from tblock_cli.anatomy import trace

    gen = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
    dataflow = trace(subject.module, subject, x, cfg.d_model)
    if path is not None:
        return load(path, subject.module, dataflow, n, cfg.n_heads, cfg.d_model)
    return derive(subject.module, dataflow, n, cfg.n_heads, cfg.d_model)
