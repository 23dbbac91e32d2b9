"""A fused GLU projection (one Linear(d, 2 h) whose output is chunked into a value and a gate: x-transformers' GLU,
a fused SwiGLU's w13) split into its two halves, the gate told from the value by measurement, not by name.

The value half enters the down projection linearly: scaling its rows (and bias) by -1 or by 2 scales what the down
projection reads by the same factor, exactly in floating point. The gate half goes through the activation, which is
neither odd and homogeneous (GELU, SiLU) nor both (ReLU is homogeneous, tanh odd): one of the two factors shows it.
Where both halves or neither enter linearly (a bilinear GLU, a norm on the hidden state) the split is refused, and
the reason is said if the parameter stays unmatched.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from tblock_cli.comparing.mapping import Slot
from tblock_cli.probes import train_mode

# The factors one half's rows are scaled by: a sign and a power of two, exact in floating point, so a linear half
# gives back s * hidden to the last bit (-1 catches a homogeneous gate such as ReLU, 2 an odd one such as tanh).
FACTORS = (-1.0, 2.0)
# max |hidden_s - s hidden| / max |s hidden| under which a half counts as linear: exact in theory; the slack covers a
# kernel that sums in another order once a weight changes. A gate through GELU or SiLU moves it by ~1e-1.
LINEAR_TOL = 1e-5
FFN_IN = ("ffn.in", "ffn.gate")


def split_glu(module: nn.Module, call, x: torch.Tensor, slots: list[Slot]) -> list[Slot]:
    """slots with each fused GLU projection's weight (and bias) split into its value (ffn.in) and gate (ffn.gate)
    halves, or left whole with the reason it could not be split."""
    params = dict(module.named_parameters())
    modules = dict(module.named_modules())
    out = list(slots)
    for weight in [s for s in slots if s.role in FFN_IN and s.part == "weight" and s.rows is None]:
        t = weight.get(params)
        if t.ndim != 2 or t.shape[0] % 2:
            continue
        h = t.shape[0] // 2
        consumers = down_projections(slots, params, modules, h)
        if not consumers:
            continue
        owner = weight.param.rpartition(".")[0]
        bias = [s for s in slots if s.part == "bias" and s.rows is None and s.param.rpartition(".")[0] == owner
                and s.role == weight.role and params[s.param].shape == (2 * h,)]
        linear = [enters_linearly(module, call, x, [weight, *bias], params, consumers, (k * h, (k + 1) * h)) for k in (0, 1)]
        if linear.count(True) != 1:
            why = ("both halves of its rows enter the down projection linearly" if all(linear) else
                   "neither half of its rows enters the down projection linearly") + \
                  ": which is the gate of a fused GLU cannot be measured"
            out = [dataclasses.replace(s, why=why) if s in (weight, *bias) else s for s in out]
            continue
        value = linear.index(True)
        halves = {"ffn.in": (value * h, (value + 1) * h), "ffn.gate": ((1 - value) * h, (2 - value) * h)}
        i = out.index(weight)
        parts = [dataclasses.replace(s, role=r, rows=rows) for s in (weight, *bias)
                 for r, rows in sorted(halves.items(), key=lambda kv: kv[1])]  # in row order: [gate, in] reads so
        out = out[:i] + parts + [s for s in out[i + 1:] if s not in bias]
    return out


def down_projections(slots: list[Slot], params: dict, modules: dict, h: int) -> list[nn.Module]:
    """The FFN output projections that read h features and run as modules of their own (a pre-hook sees their input)."""
    found = []
    for s in slots:
        if s.role != "ffn.out" or s.part != "weight" or s.rows is not None:
            continue
        t = s.get(params)
        m = modules.get(s.param.rpartition(".")[0])
        if t.ndim == 2 and t.shape[1] == h and m is not None and any(p is params[s.param] for p in m.parameters(recurse=False)):
            found.append(m)
    return found


def hidden_states(module: nn.Module, call, x: torch.Tensor, consumers: list[nn.Module]) -> list[torch.Tensor | None]:
    """What each down projection reads on one eval forward of call(x)."""
    got: list[torch.Tensor | None] = [None] * len(consumers)

    def keep(i):
        def hook(_m, args):
            if args and isinstance(args[0], torch.Tensor) and got[i] is None:
                got[i] = args[0].detach().double().clone()
        return hook
    hooks = [m.register_forward_pre_hook(keep(i)) for i, m in enumerate(consumers)]
    try:
        with train_mode(module, False), torch.no_grad():
            call(x.clone())
    finally:
        for hk in hooks:
            hk.remove()
    return got


def enters_linearly(module, call, x, slots: list[Slot], params: dict, consumers, rows: tuple[int, int]) -> bool:
    """Whether scaling these rows of the fused weight (and bias) by each factor scales what every down projection they
    reach reads by the same factor; the weights are restored exactly."""
    base = hidden_states(module, call, x, consumers)
    halves = [dataclasses.replace(s, rows=rows) for s in slots]
    saved = [s.get(params).detach().clone() for s in halves]
    reached = False
    try:
        for f in FACTORS:
            with torch.no_grad():
                for s in halves:
                    s.get(params).mul_(f)
            scaled = hidden_states(module, call, x, consumers)
            with torch.no_grad():
                for s, v in zip(halves, saved):
                    s.get(params).copy_(v)
            for b, y in zip(base, scaled):
                if b is None or y is None or b.shape != y.shape:
                    continue
                if torch.equal(b, y):
                    continue  # this down projection does not read these rows
                reached = True
                if (y - f * b).abs().max().item() > LINEAR_TOL * max(1e-30, (f * b).abs().max().item()):
                    return False
    finally:
        with torch.no_grad():
            for s, v in zip(halves, saved):
                s.get(params).copy_(v)
    return reached
