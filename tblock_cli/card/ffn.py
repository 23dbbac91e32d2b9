"""Spec readers: the FFN's activation identified from its curve (what reaches the output projection against what the
input projections wrote, fitted pointwise in float64), whether it is gated, and its hidden width."""

from __future__ import annotations

import math

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
        return [skipped("ffn.gated", why), skipped("ffn.act", why), hidden]
    if runner is not None and runner[0] <= FIT_TOL:  # the inputs did not reach where the two curves differ
        why = f"ambiguous: {how} and {runner[3]} both fit ({err:.1e}, {runner[0]:.1e}) over |x| up to {reach:.2g}"
        return [skipped("ffn.gated", why), skipped("ffn.act", why), hidden]
    return [Entry("ffn.gated", gated, where), Entry("ffn.act", act, where), hidden]



def _short(name: str) -> str:
    """A projection's last name part (the full names are in --json's dataflow)."""
    return name.rpartition(".")[2]


def _short_how(how: str) -> str:
    return " ".join(_short(w) if "." in w and "(" not in w else w for w in how.replace("(", "( ").split()).replace("( ", "(")
