"""Which projections add a bias, read off the forward: the bias argument of each projection's `F.linear` (or the
addend of Hugging Face's Conv1D `addmm`), so a bias kept beside the weight and passed in (BEiT's q_bias and v_bias)
counts and a bias parameter the forward never adds does not; nn.MultiheadAttention's projections from its own
`in_proj_bias` and `out_proj.bias`, which its one fused call reads. A projection computed otherwise (`x @ W.T + b`)
is not read: its group is left unread rather than guessed."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.anatomy.roles import FFN_ROLES
from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.sublayers import dataflow, projection_params

QKV_ROLES = ("attn.q", "attn.k", "attn.v", "attn.qk", "attn.kv", "attn.qkv")
GROUPS = {"bias.qkv": QKV_ROLES, "bias.attn": QKV_ROLES + ("attn.out",), "bias.ffn": FFN_ROLES,
          "bias.any": QKV_ROLES + ("attn.out",) + FFN_ROLES}


def read(probe: Probe) -> list[Entry]:
    flow = dataflow(probe)
    module = probe.module
    cap, _ = probe.capture(probe.x())
    added: dict[str, bool] = {}  # weight parameter -> a bias added in some call with it
    for c in cap.calls:
        weight, bias = None, None
        if c.name == "linear" and c.weight is not None:
            weight, bias = c.weight, c.args[2] if len(c.args) > 2 else c.kwargs.get("bias")
        elif c.name == "addmm" and len(c.args) > 2 and isinstance(c.args[2], torch.Tensor):
            weight, bias = cap.weight_name(c.args[2]), c.args[0]
        if weight is not None:
            added[weight] = added.get(weight, False) or (isinstance(bias, torch.Tensor) and bias.numel() > 0)
    out, mods = [], dict(module.named_modules())
    for key, roles in GROUPS.items():
        names = [m.name for m in flow.modules if m.role in roles]
        if not names:
            out.append(skipped(key, "no such projection in the dataflow"))
            continue
        seen = [_biased(module, mods, n, added) for n in names]
        if any(seen):
            biased = [n for n, b in zip(names, seen) if b]
            out.append(Entry(key, True, f"a bias added by {', '.join(biased[:3])}" + (" ..." if len(biased) > 3 else ""),
                             judged=False))
        elif all(b is False for b in seen):
            out.append(Entry(key, False, f"no bias added by {', '.join(names[:3])}" + (" ..." if len(names) > 3 else ""),
                             judged=False))
        else:
            unread = [n for n, b in zip(names, seen) if b is None]
            out.append(skipped(key, f"{unread[0]} runs outside F.linear: whether it adds a bias is not read"))
    return out


def _biased(module: nn.Module, mods: dict, name: str, added: dict[str, bool]) -> bool | None:
    """Whether the projection `name` (a dataflow row) adds a bias; None where its calls were not read. mods: the
    module's named modules."""
    params = projection_params(module, name)
    if params and params[0] in added:
        return added[params[0]]
    owner, _, part = name.rpartition(".")
    mha = mods.get(name) if isinstance(mods.get(name), nn.MultiheadAttention) else mods.get(owner)
    if isinstance(mha, nn.MultiheadAttention):
        if part == "out_proj" or name.endswith("out_proj"):
            return mha.out_proj.bias is not None
        return mha.in_proj_bias is not None
    return None
