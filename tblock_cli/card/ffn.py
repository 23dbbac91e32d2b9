"""Spec readers: the FFN's activation identified from its curve (what reaches the output projection against what the
input projections wrote, fitted pointwise in float64), whether it is gated, and its hidden width."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.sublayers import io_of, sublayers
from tblock_cli.probes import parameters_replaced

# The curves tried, as the card names them (Hugging Face's gelu_new / gelu_pytorch_tanh / gelu_fast are gelu_tanh).
ACTS = {
    "relu": torch.relu,
    "relu2": lambda x: torch.relu(x) ** 2,
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "leaky_relu": F.leaky_relu,  # slope 0.01
    "identity": lambda x: x,
}
# A fit is the activation when its largest error, relative to the largest value reaching the output projection, is
# at rounding: the true curve measured 1e-16..4e-16 in float64 on hf:llama/gpt2/bert/t5 and the zoo; a float32 step
# inside the FFN would give ~1e-7. The nearest wrong curve is gelu against gelu_tanh: 4.7e-4 apart at |x| ~ 2, ~1e-4
# relative over |x| <= 4, three decades above.
FIT_TOL = 1e-6
# The pre-activations are scaled (through the input projections' weights, restored after) to reach |x| = COVER, so
# the curves are compared where they differ (exact and tanh GELU differ most near |x| = 2; at the init's |x| ~ 0.2
# they agree to 1e-8).
COVER = 4.0
# A form fitted by no known curve reads as ffn.act "other" (a curve of its own, never claimed by a --like reference,
# held against a claimed name) where it misses every known curve, even after a scale and shift per row (a norm after
# the activation), by more than OTHER_MIN and less than OTHER_MAX (relative: 100x FIT_TOL, above a float32 step's 1e-7;
# a near miss of a known curve, not a misread FFN), and the misfit is a smooth function of the pre-activation: a
# quadratic fitted within each of 32 runs of it leaves at most SMOOTH_MAX of the misfit's norm. Measured on 4096-40960
# points at |x| <= 4: a typo in gelu_tanh's 0.044715 (x10) misses by 2e-2, x * sigmoid(1.1 x) by 1e-2, both leaving
# 3e-3..8e-3; a LayerNorm after GELU leaves 7e-2..0.23 (and fits a per-row affine GELU exactly), GELU rounded to
# bfloat16 or float32 0.87..1; a Mamba mixer's output read as an FFN's (hf:jamba at d_model 512) misses by 2.2.
OTHER_MIN = 1e-4
OTHER_MAX = 0.25
SMOOTH_MAX = 0.02


def _err(h: torch.Tensor, f: torch.Tensor) -> float:
    return (h - f).abs().max().item() / max(h.abs().max().item(), 1e-300)


def _candidates(outs: dict, width: int, rows: int) -> dict[str, torch.Tensor]:
    """Input-projection outputs that can reach a hidden layer of `width`: whole, or each half of a fused gate/up."""
    out = {}
    for n, t in outs.items():
        if t is None or t.shape[0] != rows:
            continue
        if t.shape[-1] == width:
            out[n] = t
        elif t.shape[-1] == 2 * width:
            out[f"{n}[:{width}]"], out[f"{n}[{width}:]"] = t[:, :width], t[:, width:]
    return out


def fit(h: torch.Tensor, cands: dict[str, torch.Tensor]) -> list[tuple[float, str, bool, str]]:
    """Every form tried, best first: (error, activation, gated, how) for h = act(p), act(g) * u and act(g * u)."""
    tries = []
    for act, f in ACTS.items():
        for n, p in cands.items():
            tries.append((_err(h, f(p)), act, False, f"{act}({n})"))
        for g, pg in cands.items():
            for u, pu in cands.items():
                if g == u:
                    continue
                tries.append((_err(h, f(pg) * pu), act, True, f"{act}({g}) * {u}"))
                if g < u and act != "identity":
                    tries.append((_err(h, f(pg * pu)), f"{act}(gate*up)", True, f"{act}({g} * {u})"))
                    # the activation on both halves (silu(gate) * silu(up)): no GLU's, whatever its config says
                    tries.append((_err(h, f(pg) * f(pu)), f"{act}(gate)*{act}(up)", True, f"{act}({g}) * {act}({u})"))
    return sorted(tries, key=lambda t: (t[0] if math.isfinite(t[0]) else math.inf))


def read(probe: Probe) -> list[Entry]:
    keys = ("ffn.gated", "ffn.act", "ffn.hidden")
    sub = sublayers(probe)
    down = sub.first("ffn.out")
    if down is None:
        return [skipped(k, "no FFN in the dataflow (no projection reads another's output)") for k in keys]
    h = sub.seen.proj_in.get(down)
    if h is None:
        return [skipped(k, f"the FFN's output projection {down} runs outside F.linear or a module of its own") for k in keys]
    ins = [n for r in ("ffn.in", "ffn.gate") for n in sub.roles.get(r, ())]
    width, rows = h.shape[-1], h.shape[0]
    cands = _candidates({n: sub.seen.proj_out.get(n) for n in ins}, width, rows)
    hidden = Entry("ffn.hidden", width, f"the width reaching {_short(down)}", judged=False)
    if not cands:
        return [skipped("ffn.gated", f"no input projection's output matches {down}'s input width {width}"),
                skipped("ffn.act", f"no input projection's output matches {down}'s input width {width}"), hidden]
    # scale each input projection so its output reaches |x| = COVER, then read the forward again
    used = sorted({n.split("[")[0] for n in cands})
    peak = {n: sub.seen.proj_out[n].abs().max().item() for n in used}
    weights = [sub.params[n][0] for n in used if sub.params.get(n)]
    factor = {sub.params[n][0]: COVER / peak[n] for n in used if sub.params.get(n) and peak[n] > 0}
    with parameters_replaced(dict(probe.module.named_parameters()), weights, lambda n, p: p * factor.get(n, 1.0)):
        seen = io_of(probe, {n: sub.params.get(n, ()) for n in used + [down]}, (), sub.seen.x)
    h2 = seen.proj_in.get(down)
    cands2 = _candidates({n: seen.proj_out.get(n) for n in used}, width, rows) if h2 is not None else {}
    if h2 is not None and cands2:
        h, cands = h2, cands2
    tries = fit(h, cands)
    err, act, gated, how = tries[0]
    reach = max(t.abs().max().item() for t in cands.values())
    runner = next((t for t in tries[1:] if t[1] != act), None)
    where = f"{_short(down)} input = {_short_how(how)} to {err:.0e}, |x| <= {reach:.2g}"
    if runner is not None:
        where += f"; next {runner[1]} {runner[0]:.0e}"
    if not err <= FIT_TOL:
        why = f"no known activation: the best fit, {how}, is off by {err:.1e} (relative)"
        if OTHER_MIN < err < OTHER_MAX and (share := own_curve(h, cands, tries)) is not None:
            # a curve of its own, read pointwise: said, so that a claimed activation is judged against it
            return [skipped("ffn.gated", why), Entry("ffn.act", "other", f"{why}; the misfit is a smooth function of "
                                                     f"the pre-activation ({share:.0e} of it left by a local quadratic): "
                                                     f"a curve of its own", judged=False), hidden]
        return [skipped("ffn.gated", why), skipped("ffn.act", why), hidden]
    if runner is not None and runner[0] <= FIT_TOL:  # the inputs did not reach where the two curves differ
        why = f"ambiguous: {how} and {runner[3]} both fit ({err:.1e}, {runner[0]:.1e}) over |x| up to {reach:.2g}"
        return [skipped("ffn.gated", why), skipped("ffn.act", why), hidden]
    return [Entry("ffn.gated", gated, where), Entry("ffn.act", act, where), hidden]



def _form(how: str, cands: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A fitted form's pre-activation and, gated, the factor it multiplies: act(p) or act(p) * u. None for act(g * u)."""
    gated = re.fullmatch(r"\w+\(([^()]+)\) \* (.+)", how)
    plain = re.fullmatch(r"\w+\(([^()*]+)\)", how)
    m = gated or plain
    if m is None or not all(n in cands for n in m.groups()):
        return None
    return cands[m.group(1)], (cands[gated.group(2)] if gated else None)


def _row_affine_residual(h: torch.Tensor, f: torch.Tensor) -> float:
    """How far h is from a * f + b with a and b per row (least squares), relative to h's largest value."""
    fc, hc = f - f.mean(-1, keepdim=True), h - h.mean(-1, keepdim=True)
    a = (fc * hc).sum(-1, keepdim=True) / (fc * fc).sum(-1, keepdim=True).clamp_min(1e-300)
    return (hc - a * fc).abs().max().item() / max(h.abs().max().item(), 1e-300)


def unexplained(p: torch.Tensor, r: torch.Tensor, bins: int = 32) -> float:
    """The share of r (its norm) that a quadratic in p, fitted within each of `bins` runs of sorted p, leaves: ~0
    where r is a smooth function of p, ~1 where it is noise."""
    order = p.flatten().argsort()
    p, r = p.flatten()[order], r.flatten()[order]
    step, left = max(p.numel() // bins, 8), torch.zeros((), dtype=torch.float64)
    for i in range(0, p.numel(), step):
        d, rr = p[i : i + step] - p[i : i + step].mean(), r[i : i + step]
        if d.numel() < 4:
            continue
        A = torch.stack([torch.ones_like(d), d, d * d], 1)
        left = left + (A @ torch.linalg.lstsq(A, rr[:, None]).solution - rr[:, None]).pow(2).sum()
    return left.sqrt().item() / max(r.norm().item(), 1e-300)


def own_curve(h: torch.Tensor, cands: dict[str, torch.Tensor], tries: list) -> float | None:
    """Where what reaches the output projection is a curve of its own: no known curve's best form, followed by a
    per-row scale and shift (a norm after the activation, NormFormer's), fits it, and the best form's misfit is a smooth
    function of its pre-activation (its unexplained share, returned). None otherwise."""
    forms = {}  # each known curve's best form (tries come best first), as (pre-activation, gated factor or None)
    for _err, act, _gated, how in tries:
        if act in ACTS and act not in forms:
            forms[act] = _form(how, cands)
    for act, form in forms.items():
        if form is not None and h.ndim == 2 and \
                _row_affine_residual(h, ACTS[act](form[0]) * (form[1] if form[1] is not None else 1)) <= OTHER_MIN:
            return None
    act = tries[0][1]
    if forms.get(act) is None:
        return None
    p, u = forms[act]
    if u is not None:  # the gate's curve: h / up where up is not small
        keep = u.abs() >= 0.25 * u.abs().max()
        p, r = p[keep], h[keep] / u[keep] - ACTS[act](p[keep])
    else:
        r = h - ACTS[act](p)
    if r.numel() < 64:
        return None
    share = unexplained(p, r)
    return share if share <= SMOOTH_MAX else None


def _short(name: str) -> str:
    """A projection's last name part (the full names are in --json's dataflow)."""
    return name.rpartition(".")[2]


def _short_how(how: str) -> str:
    return " ".join(_short(w) if "." in w and "(" not in w else w for w in how.replace("(", "( ").split()).replace("( ", "(")
