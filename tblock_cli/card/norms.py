"""Spec readers: the residual-stream norms, each probed black-box on inputs of its own (kind from a constant offset,
eps from near-constant inputs, a (1 + w) weight from a zeroed weight), and their placement read off the dataflow."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.probe import Probe
from tblock_cli.card.sublayers import same_tensor, sublayers
from tblock_cli.probes import parameters_replaced

# LayerNorm ignores a constant added to every channel; RMSNorm does not. In float64 the change is 1e-16 for a
# LayerNorm, 1e-7 where HF computes the norm in float32; an RMSNorm moves by O(1) under the offset used (3 x the rms).
KIND_TOL = 1e-4
# An RMSNorm's output over its input is one factor per token times its weight per channel: the ratio of two tokens'
# outputs over inputs is the same in every channel to 1e-15 (float64), 1e-7 (float32 inside); a LayerNorm's spreads O(1).
RMS_TOL = 1e-4
# eps from out(s v) / out(S v) = s / sqrt(s^2 + eps) for a zero-mean, unit-variance v: read where that ratio is between
# these (informative: ~ s^2 / eps away from both 0 and 1), S^2 = 1e6 times any eps read. A float32 norm reads eps to
# 1e-5 relative, float64 to 1e-10; the estimates at different s must agree within EPS_TOL, which is also the card's
# tolerance: a wrong eps is off by a decade (1e-5 for 1e-6), the 5 % leaves margin for float32 norms at small s.
RATIO_RANGE = (0.05, 0.98)
EPS_TOL = 0.05
S_LARGE = 1e3
S_SCAN = tuple(10.0 ** (-k / 2) for k in range(0, 33))  # s from 1 down to 1e-16: eps from ~1 down to ~1e-32
# No floor seen down to the smallest s: eps is below s^2 (1e-32) and read as 0.
# A (1 + w) norm with every parameter zeroed still outputs the normalised input (rms 1); a w norm outputs 0.
OFFSET_LIVE, OFFSET_DEAD = 0.5, 1e-9


def _v(probe: Probe, width: int, tokens: int = 4) -> torch.Tensor:
    return unit_tokens(probe.randn(1, tokens, width))


def unit_tokens(v: torch.Tensor) -> torch.Tensor:
    """v with each token zero-mean and of mean square 1, so LayerNorm's variance and RMSNorm's mean square are both 1."""
    v = v - v.mean(-1, keepdim=True)
    return v / v.pow(2).mean(-1, keepdim=True).sqrt()


def _call(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = m(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.detach().double()


def kind(m, v: torch.Tensor) -> tuple[str | None, str]:
    b = (_call(m, v) + _call(m, -v)) / 2  # the norm's bias: the odd part of a norm is w * v * r
    a = _call(m, v)
    shifted = _call(m, v + 3.0)
    moved = (shifted - a).abs().max().item() / max(a.abs().max().item(), 1e-300)
    if moved <= KIND_TOL:
        return "layernorm", f"a constant offset leaves the output ({moved:.0e})"
    u = v * torch.linspace(0.5, 2.0, v.shape[1], dtype=v.dtype, device=v.device).view(1, -1, 1)
    u = u + 0.3 * torch.sign(u)  # tokens of other means and spreads, away from 0
    q = (_call(m, u) - b) / u  # (1, T, C): w_c * r_t for an RMSNorm
    live = q[0, 0].abs() > 1e-8 * q[0, 0].abs().max()
    ratio = q[0, :, live] / q[0, :1, live]
    spread = ((ratio - ratio.mean(-1, keepdim=True)).abs().max() / ratio.abs().mean()).item()
    if spread <= RMS_TOL:
        return "rmsnorm", f"a constant offset moves the output ({moved:.1g}); output/input: one factor per token"
    return None, f"neither: an offset moves the output ({moved:.1e}) and output/input varies by channel ({spread:.1e})"


def eps(m, v: torch.Tensor) -> tuple[float | None, str, str | None]:
    """The floor eps, how it was read, and its form: "sqrt" (x / sqrt(var + eps)) or "std" (x / (std + eps)); no
    floor (eps 0) has no form."""
    b = (_call(m, v) + _call(m, -v)) / 2
    big = _call(m, S_LARGE * v) - b
    live = big.abs() > 1e-6 * big.abs().max()
    sqrt_form, std_form = [], []
    for s in S_SCAN:
        rho = ((_call(m, s * v) - b)[live] / big[live]).median().item()
        if RATIO_RANGE[0] < rho < RATIO_RANGE[1]:
            sqrt_form.append(s * s * (1 / rho ** 2 - 1))
            std_form.append(s * (1 / rho - 1))
    if not sqrt_form:
        return 0.0, f"no floor: out(s v) / out({S_LARGE:g} v) = 1 down to s = {S_SCAN[-1]:.0e}", None
    for est, form, word in ((sqrt_form, "sqrt(var + eps)", "sqrt"), (std_form, "(std + eps)", "std")):
        lo, hi = min(est), max(est)
        if hi - lo <= EPS_TOL / 4 * hi:
            mid = float(f"{sorted(est)[len(est) // 2]:.6g}")  # a float32 eps (1e-6 is 9.99999997e-7) shown as set
            return mid, f"out(s v)/out({S_LARGE:g} v) = s/{form} at {len(est)} s (spread {(hi - lo) / hi:.0e})", word
    return (None, f"the floor follows neither sqrt(var + eps) nor std + eps (estimates {min(sqrt_form):.2g}.."
                  f"{max(sqrt_form):.2g})", None)


def offset(probe: Probe, name: str, m, v: torch.Tensor) -> tuple[bool | None, str]:
    if not isinstance(m, nn.Module):
        return None, "a norm called as a function: its weight, an argument, cannot be told from a (1 + w)"
    own = [f"{name}.{n}" if name else n for n, _ in m.named_parameters()]
    if not own:
        return None, "the norm has no weight"
    with parameters_replaced(dict(probe.module.named_parameters()), own, lambda _n, p: torch.zeros_like(p)):
        out = _call(m, v)
    r = out.pow(2).mean().sqrt().item()
    if r >= OFFSET_LIVE:
        return True, f"parameters zeroed: output rms {r:.3g}, a (1 + w) scale"
    if r <= OFFSET_DEAD:
        return False, "parameters zeroed: output 0, a w scale"
    return None, f"with its parameters zeroed the norm outputs rms {r:.3g}: neither 0 nor the normalised input"


def _agreed(values: list, tol: float = 0.0):
    """One value when every norm gives the same (within tol), else the tuple of them (in the order they ran)."""
    first = values[0]
    if isinstance(first, float) and all(abs(v - first) <= tol * max(abs(first), abs(v)) for v in values):
        return first
    if not isinstance(first, float) and all(v == first for v in values):
        return first
    return tuple(values) if isinstance(first, float) else "mixed"


def placement(probe: Probe) -> tuple[str | None, str]:
    """pre, post, sandwich or olmo2, from which tensors the stream norms read and which sublayers read them."""
    sub = sublayers(probe)
    flow = sub.flow
    if not flow.attention and not flow.found["ffn"]:
        return None, "no sublayers found"
    outs = [sub.seen.proj_out.get(n) for r in ("attn.out", "ffn.out") for n in sub.roles.get(r, ())]
    post_sub = [n for n in sub.norms if any(same_tensor(sub.seen.norm_in.get(n), o) for o in outs)]
    branches = len(sub.roles.get("attn.out", ())) + len(sub.roles.get("ffn.out", ())[:1])
    reads_normed = not flow.unnormed_attention and not flow.unnormed_ffn
    reads_raw = bool(flow.unnormed_attention) and bool(flow.unnormed_ffn)
    if flow.sublayer_post or (reads_raw and len(post_sub) >= branches > 0):
        return "olmo2", "sublayers read the raw stream; their outputs are normalised before the add"
    if reads_normed and len(post_sub) >= branches > 0:
        return "sandwich", "sublayers read a normalised stream; their outputs are normalised before the add"
    if post_sub:
        return None, f"mixed: {len(post_sub)} of {branches} branch outputs normalised before the add"
    if reads_normed and not flow.output_normed:
        return "pre", "sublayers read a normalised stream; the sums are not normalised"
    if flow.output_normed and flow.unnormed_attention:
        return "post", "attention reads the raw stream; the output comes from a norm"
    if reads_normed:
        return "pre", "sublayers read a normalised stream (and a norm on the output)"
    return None, "mixed: some sublayers read a normalised stream, some the raw one"


def read(probe: Probe) -> list[Entry]:
    keys = ("norm.kind", "norm.eps", "norm.eps_form", "norm.offset", "norm.placement")
    sub = sublayers(probe)
    if not sub.norms:  # a norm written inline in the block's own forward is neither a module nor a norm call
        why = "no norm module or norm call on the residual stream (a norm written out inline is not read)"
        return [skipped(k, why) for k in keys]
    v = _v(probe, probe.d)
    kinds, epss, forms, offs = [], [], [], []
    for name in sub.norms:
        m = sub.norm(probe.module, name)
        kinds.append(kind(m, v))
        value, how, form = eps(m, v)
        epss.append((value, how))
        forms.append((form, "no floor (eps 0): no form to read" if value == 0.0 else how))
        offs.append(offset(probe, name, m, v))
    names = f"{len(sub.norms)} norms" if len(sub.norms) > 1 else sub.norms[0].rpartition(".")[2]
    out = []
    for key, got, tol in (("norm.kind", kinds, 0.0), ("norm.eps", epss, EPS_TOL), ("norm.eps_form", forms, 0.0),
                          ("norm.offset", offs, 0.0)):
        bad = [(n, why) for n, (val, why) in zip(sub.norms, got) if val is None]
        if bad:
            out.append(skipped(key, f"{bad[0][0]}: {bad[0][1]}"))
            continue
        value = _agreed([val for val, _ in got], tol)
        out.append(Entry(key, value, f"{names}: {got[0][1]}", tol=tol))
    where, why = placement(probe)
    out.append(Entry("norm.placement", where, why) if where else skipped("norm.placement", why))
    return out
