"""Spec readers: the mixture-of-experts entries of the card, read with every expert made identical (expert 0's weights
copied into all): the mixture's output is then one expert's output times the sum of the token's routing weights, and
zeroing one expert at a time reads each token's weight for that expert, held against the router's own outputs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.experts import FEW_TOKENS, MANY_EXPERTS, Experts, Mixture, find, one_expert
from tblock_cli.card.groups import groups_entry
from tblock_cli.card.probe import Probe
from tblock_cli.probes import train_mode

KEYS = ("moe.experts", "moe.top_k", "moe.router", "moe.renorm", "moe.scale", "moe.weight_sum", "moe.select",
        "moe.groups", "moe.shared", "moe.shared_gate")
# A routing weight below this fraction of the token's largest counts as "not routed": an unrouted expert's
# zeroing changes nothing at all (exactly 0 in float64); the smallest real weight met (a sigmoid of a large
# negative logit among qwen2_moe's 60 experts) is ~1e-4 of the largest.
ROUTED_MIN = 1e-9
# The mixture's output with identical experts against one expert's output: parallel within float32 rounding
# (routers that cast to float32: mixtral, deepseek_v3), 1e-7 measured; a nonlinearity after the mixture bends it
# by far more.
PARALLEL_TOL = 1e-5
# A routing form (softmax over the chosen / over all, sigmoid, sigmoid over the chosen, times one constant) fits
# the per-token weights within float32 rounding of the router (1e-7..2e-7 measured on mixtral, qwen2_moe, olmoe,
# qwen3_moe, deepseek_v3); the nearest wrong form misses by >= 2e-2 on each (0.17..0.54 but for the top 8 sigmoids of
# deepseek_v3's 256 experts, which sum alike over tokens: 0.023).
FIT_TOL = 1e-4
# The sum of a token's weights counts as one constant when it varies by less than this over the tokens (rounding:
# 1e-7); without renormalisation it spreads by tens of percent.
SUM_TOL = 1e-4
# A sigmoid gate on the shared expert: the mixture moved by the gate's logits made 0 and 2g against the ratio a
# sigmoid predicts, within float64 rounding (1e-12 measured on qwen2_moe, qwen3_next); tokens whose logit is within
# GATE_MIN_LOGIT of 0 are left out (both moves vanish there).
GATE_TOL = 1e-5
GATE_MIN_LOGIT = 1e-3
# The router's weights are redrawn at this std x 1/sqrt(d) while read: scores of order 1 on a normalised stream, so
# softmax over the chosen and over all differ by tens of percent per token (at HF's init std 0.02 they differ by 2-5%,
# and a router initialised to zeros ties every score).
ROUTER_STD = 1.0
UNUSED = "pieces whose zeroing one at a time changes no output"


def _fits(w: torch.Tensor, z: torch.Tensor, routed: torch.Tensor) -> dict[tuple[str, bool], tuple[float, float]]:
    """How far each routing form, times one constant, is from the weights w (N, E) of the experts routed (N, E) given
    the router's outputs z (N, E): {form: (relative misfit, constant)}."""
    neg = torch.full_like(z, -math.inf)
    forms = {
        ("softmax", True): torch.softmax(torch.where(routed, z, neg), -1),
        ("softmax", False): torch.softmax(z, -1),
        ("sigmoid", False): torch.sigmoid(z),
    }
    s = torch.where(routed, torch.sigmoid(z), torch.zeros_like(z))
    forms[("sigmoid", True)] = s / s.sum(-1, keepdim=True)
    out = {}
    for form, h in forms.items():
        h = torch.where(routed, h, torch.zeros_like(h))
        ratio = w[routed] / h[routed]
        c = ratio.median().item()
        if not math.isfinite(c) or c == 0:
            continue
        misfit = ((w - c * h).abs()[routed] / (c * h).abs()[routed]).max().item()
        out[form] = (misfit, c)
    return out


def _dense(why: str) -> list[Entry]:
    return [Entry("moe.experts", 0, how=why, judged=False)] + [skipped(k, "no experts") for k in KEYS[1:]]


def _router_weight(probe: Probe, router) -> nn.Parameter | None:
    """The parameter the router's linear multiplies by: named where the call took it as it is, else the one of the
    same shape and values (DeepSeek-V3's router casts its weight to float32 first)."""
    if router.weight is not None:
        return probe.module.get_parameter(router.weight)
    w = router.args[1] if len(router.args) > 1 else router.kwargs.get("weight")
    if not isinstance(w, torch.Tensor):
        return None
    w = w.to(torch.float64)
    return next((p for p in probe.module.parameters() if p.shape == w.shape and
                 torch.allclose(p.detach().to(torch.float64), w, rtol=1e-6, atol=1e-12)), None)


def read(probe: Probe) -> list[Entry]:
    x = probe.x(1)
    cap, _ = probe.capture(x)
    found = find(probe, cap)
    if found is None:
        return _dense("no set of identical experts with a router (a linear to one output per expert) in the block")
    g, router, path, selects = found
    rw = _router_weight(probe, router)
    saved = [(p, p.detach().clone()) for p in g.params() + ([rw] if rw is not None else [])]
    try:
        if rw is not None:  # scores of order 1 whatever the router's init (zeros, std 0.02): forms tell apart
            with torch.no_grad():
                rw.copy_(torch.randn(rw.shape, generator=probe.gen, dtype=torch.float64).to(rw) * ROUTER_STD
                         / rw.shape[-1] ** 0.5)
            again = find(probe, probe.capture(x)[0])
            if again is not None and again[0].n == g.n:
                router = again[1]
            else:  # read as it is
                with torch.no_grad():
                    rw.copy_(saved[-1][1])
                rw = None
        routing = _read_mixture(probe, g, router, path, x)
    finally:
        with torch.no_grad():
            for p, v in saved:
                p.copy_(v)
    k = next((e.value for e in routing if e.key == "moe.top_k" and e.read), None)
    if any(e.key == "moe.top_k" and e.skip and e.skip.startswith(UNUSED) for e in routing):
        return _dense(f"{g.n} same-shaped {UNUSED}: not experts")
    if k == g.n and not selects:
        return _dense(f"{g.n} same-shaped modules weighted by a linear, but every token goes through all of them and "
                      f"nothing selects among them: no routing")
    redrawn = " (its weights redrawn at std 1/sqrt(d) while read)" if rw is not None else ""
    return [Entry("moe.experts", g.n, how=f"{g.n} same-shaped experts at {g.path or 'the block'}, routed by a "
                                          f"linear to {g.n} outputs{redrawn}", judged=False)] + routing


def _read_mixture(probe: Probe, g: Experts, router, path: str, x: torch.Tensor) -> list[Entry]:
    mix = Mixture(probe, path, x)
    z = router.out.reshape(-1, g.n).to(torch.float64)
    if g.n >= MANY_EXPERTS and (n := mix.limit(FEW_TOKENS)) > 0:
        z = z[:n]
    u = router.args[0] if router.args else router.kwargs.get("input")
    u = u.reshape(-1, u.shape[-1]).to(torch.float64)[: z.shape[0]]
    inp = mix.input
    inp = inp.reshape(-1, inp.shape[-1]).to(torch.float64)[: z.shape[0]] if inp is not None else None
    if inp is not None and inp.shape == u.shape and (inp - u).abs().max() <= 1e-5 * u.abs().max():
        u = inp  # the mixture's own input, where the router read a float32 copy of it (DeepSeek-V3)
    return _read_routing(probe, g, mix, router, z, u)


def _set_identical(g: Experts) -> None:
    with torch.no_grad():
        src = [t.clone() for t in g.tensors(0)]
        for e in range(1, g.n):
            for t, s in zip(g.tensors(e), src):
                t.copy_(s)


def _zero(g: Experts, experts) -> None:
    with torch.no_grad():
        for e in experts:
            for t in g.tensors(e):
                t.zero_()


def _read_routing(probe: Probe, g: Experts, mix: Mixture, router, z: torch.Tensor, u: torch.Tensor) -> list[Entry]:
    _set_identical(g)
    y_same = mix()
    per_expert = []
    for e in range(g.n):  # each token's weight for expert e: what zeroing that one expert takes away
        keep = [t.clone() for t in g.tensors(e)]
        _zero(g, [e])
        per_expert.append(y_same - mix())
        with torch.no_grad():
            for t, k in zip(g.tensors(e), keep):
                t.copy_(k)
    saved_same = [t.clone() for t in g.tensors(0)]
    _zero(g, range(g.n))
    y_none = mix()
    d = y_same - y_none  # (N, d): the routed experts' part, every expert the same
    shared = _shared(probe, mix, y_none, d)  # read with the routed experts zeroed
    with torch.no_grad():
        for e in range(g.n):
            for t, s in zip(g.tensors(e), saved_same):
                t.copy_(s)
    n_tok = d.shape[0]
    if z.shape[0] != n_tok:
        return [skipped(k, f"the router scored {z.shape[0]} tokens, the mixture returned {n_tok}") for k in KEYS[1:]]
    with train_mode(probe.module, False):  # an expert's own dropout off, as in the mixture's runs
        v = one_expert(g, u) if u.shape[0] == n_tok else None
    out: list[Entry] = []
    # which experts each token is routed to: the ones whose zeroing changes its output
    moved = torch.stack([p.norm(dim=-1) for p in per_expert], -1)  # (N, E)
    routed = moved > ROUTED_MIN * moved.max(-1, keepdim=True).values.clamp_min(1e-300)
    counts = routed.sum(-1)
    if int(counts.max()) == 0:
        return [skipped("moe.top_k", f"{UNUSED} of any token")]
    if bool((counts == counts[0]).all()) and counts[0] > 0:
        k = int(counts[0])
        out.append(Entry("moe.top_k", k, how=f"experts whose zeroing changes a token's output: {k} for each of "
                                             f"{n_tok} tokens (every expert made identical)"))
    else:
        out.append(skipped("moe.top_k", f"experts per token vary over tokens ({int(counts.min())}..{int(counts.max())}):"
                                        " not a fixed top-k"))
    out += shared
    if v is None:  # ratios of weights only: the router's form, and renormalisation from a router zeroed
        return out + _relative(probe, mix, router, z, d, y_none, per_expert, routed) + _select(z, routed, counts)
    vv = (v * v).sum(-1).clamp_min(1e-300)
    S = (d * v).sum(-1) / vv  # (N,) each token's summed weight
    bend = ((d - S[:, None] * v).norm(dim=-1) / d.norm(dim=-1).clamp_min(1e-300)).max().item()
    if bend > PARALLEL_TOL:
        why = (f"the mixture's output is not one expert's output times a weight per token (off by {bend:.2g}): a "
               f"nonlinearity after the experts, or experts that do not read the router's input")
        return out + [skipped(k, why) for k in ("moe.router", "moe.renorm", "moe.scale", "moe.weight_sum", "moe.select")]
    w = torch.stack([(p * v).sum(-1) / vv for p in per_expert], -1)  # (N, E) each token's weight per expert
    w = torch.where(routed, w, torch.zeros_like(w))
    lo, hi, mean = S.min().item(), S.max().item(), S.mean().item()
    how_sum = (f"the experts' summed output over one expert's output, every expert made identical: {lo:.6g}..{hi:.6g} "
               f"over {n_tok} tokens")
    if hi - lo <= SUM_TOL * max(abs(mean), 1e-300):
        out.append(Entry("moe.weight_sum", mean, how=how_sum, tol=1e-3))
    else:
        out.append(Entry("moe.weight_sum", "varies", how=how_sum))
    return out + _forms(_fits(w, z, routed), routed) + _select(z, routed, counts)


def _select(z: torch.Tensor, routed: torch.Tensor, counts: torch.Tensor) -> list[Entry]:
    """moe.select: the chosen experts are the ones with the largest router outputs, or not; moe.groups: the group
    limits that explain the choice (card/groups.py `groups_entry`)."""
    top = torch.zeros_like(routed)
    top.scatter_(-1, z.topk(int(counts.max()), -1).indices, True)
    plain = bool((top == routed).all())
    return [Entry("moe.select", "top" if plain else "other", judged=False,
                  how="the routed experts are the largest router outputs for every token" if plain else
                  "the routed experts are not the largest router outputs for some token (a selection bias, "
                  "group-limited routing, or another rule)"), groups_entry(z, routed, counts, plain)]


def _forms(fits: dict, routed: torch.Tensor) -> list[Entry]:
    """moe.router, moe.renorm and moe.scale (where the fits carry constants): which routing form fits."""
    good = {f: c for f, (m, c) in fits.items() if m <= FIT_TOL}
    shown = ", ".join(f"{r}{' over the chosen' if n else ''} {fits[(r, n)][0]:.2g}" for r, n in fits)
    how = f"each token's weight per expert against the router's outputs; misfits: {shown}"
    routers = {r for r, _ in good}
    if not good:
        why = f"the routing weights fit no softmax or sigmoid of the router's outputs ({shown})"
        return [Entry("moe.router", "other", how=why)] + [skipped(k, why) for k in ("moe.renorm", "moe.scale")]
    out = []
    if len(routers) == 1:
        out.append(Entry("moe.router", next(iter(routers)), how=how))
    else:
        out.append(skipped("moe.router", "softmax and sigmoid fit alike (one expert per token, renormalised): the "
                                         "weight is the constant whatever the scores"))
    renorms = {n for _, n in good}
    if len(renorms) == 1:
        out.append(Entry("moe.renorm", next(iter(renorms)), how=how))
    elif routed.all():
        out.append(Entry("moe.renorm", True, how="every expert is chosen: the weights over all sum as over the chosen"))
    else:
        out.append(skipped("moe.renorm", f"forms with and without renormalisation fit alike ({shown})"))
    if any(c is None for c in good.values()):
        why = "one expert's output could not be computed alone (its call convention is not known): only ratios of weights"
        return out + [skipped("moe.scale", why)]
    scales = {round(c, 9) for c in good.values()}
    c = next(iter(good.values()))
    if max(scales) - min(scales) <= 1e-3 * abs(c):
        out.append(Entry("moe.scale", c, how=f"the constant factor on the fitting form's weights: {c:.6g}", tol=1e-3))
    else:
        out.append(skipped("moe.scale", "the fitting forms take different constants"))
    return out


def _relative(probe: Probe, mix: Mixture, router, z, d, y_none, per_expert, routed) -> list[Entry]:
    """Where one expert cannot be called alone: each token's weights relative to their sum (each expert's part of
    the mixture's output, every expert the same), and the sum against its value with the router's weights zeroed
    (every score equal: softmax 1/E, sigmoid 1/2 each); each form predicts both, whatever constant scales it."""
    why = "one expert's output could not be computed alone (its call convention is not known): only ratios of weights"
    scale_sum = [skipped("moe.weight_sum", why)]
    name = router.weight
    if name is None:
        return scale_sum + [skipped(k, why + ", and the router is not a parameter's linear")
                            for k in ("moe.router", "moe.renorm", "moe.scale")]
    owner = probe.module.get_submodule(name.rpartition(".")[0])
    params = list(owner.parameters(recurse=False)) if isinstance(owner, nn.Linear) else [probe.module.get_parameter(name)]
    saved = [(p, p.detach().clone()) for p in params]
    try:
        with torch.no_grad():
            for p, _ in saved:
                p.zero_()
        d0 = mix() - y_none
    finally:
        with torch.no_grad():
            for p, v in saved:
                p.copy_(v)
    dd = (d * d).sum(-1).clamp_min(1e-300)
    r = torch.stack([(p * d).sum(-1) / dd for p in per_expert], -1)  # (N, E) weight / the token's sum
    ratio = (d * d0).sum(-1) / (d0 * d0).sum(-1).clamp_min(1e-300)  # the token's sum / its sum at equal scores
    bend = ((d - ratio[:, None] * d0).norm(dim=-1) / d.norm(dim=-1).clamp_min(1e-300)).max().item()
    if bend > PARALLEL_TOL:
        w = f"the mixture's output bends off one direction per token by {bend:.2g} (a nonlinearity after the experts)"
        return scale_sum + [skipped(k, w) for k in ("moe.router", "moe.renorm", "moe.scale")]
    k = routed.sum(-1, keepdim=True).to(z.dtype)
    E = z.shape[-1]
    neg = torch.full_like(z, -math.inf)
    sig = torch.where(routed, torch.sigmoid(z), torch.zeros_like(z))
    forms = {("softmax", True): (torch.softmax(torch.where(routed, z, neg), -1), torch.ones_like(k)),
             ("softmax", False): (torch.softmax(z, -1), k / E),
             ("sigmoid", False): (torch.sigmoid(z), k / 2),
             ("sigmoid", True): (sig / sig.sum(-1, keepdim=True), torch.ones_like(k))}
    fits = {}
    for form, (h, at_equal) in forms.items():
        h = torch.where(routed, h, torch.zeros_like(h))
        total = h.sum(-1, keepdim=True)
        rel = ((r - h / total).abs()[routed] / (h / total)[routed]).max().item()
        summed = ((ratio[:, None] - total / at_equal).abs() / (total / at_equal)).max().item()
        fits[form] = (max(rel, summed), None)
    return scale_sum + _forms(fits, routed)


def _shared(probe: Probe, mix: Mixture, y_none: torch.Tensor, d: torch.Tensor) -> list[Entry]:
    """A path every token takes besides the routed experts (read with every routed expert zeroed), and its gate."""
    if not mix.alone:
        why = "the mixture is not a module of its own: a shared expert cannot be told from the residual"
        return [skipped("moe.shared", why), skipped("moe.shared_gate", why)]
    size = y_none.norm(dim=-1).max().item()
    if size <= ROUTED_MIN * d.norm(dim=-1).max().item():
        return [Entry("moe.shared", False, how="zero output with every routed expert zeroed"),
                skipped("moe.shared_gate", "no shared expert")]
    inp = mix.input
    if inp is not None and inp.numel() == y_none.numel() and \
            (y_none - inp.reshape(y_none.shape)).norm(dim=-1).max().item() <= ROUTED_MIN * size:
        return [Entry("moe.shared", False, how="with every routed expert zeroed the mixture returns its input (a residual "
                                               "inside it)"), skipped("moe.shared_gate", "no shared expert")]
    out = [Entry("moe.shared", True, how="nonzero output with every routed expert zeroed")]
    gate = _gate_linear(probe, mix)
    if gate is None:
        return out + [Entry("moe.shared_gate", "none", how="no linear to one output per token inside the mixture")]
    module, logits = gate
    saved = [(p, p.detach().clone()) for p in module.parameters()]
    runs = []
    try:
        for factor in (0.0, 2.0):  # the gate's logits g made 0, then 2g (a linear: its bias scales alike)
            with torch.no_grad():
                for p, v in saved:
                    p.copy_(v * factor)
            runs.append(mix())
    finally:
        with torch.no_grad():
            for p, v in saved:
                p.copy_(v)
    zero, double = runs
    g = logits.reshape(-1).to(torch.float64)
    if g.numel() != y_none.shape[0]:
        return out + [skipped("moe.shared_gate", "the gate's outputs do not line up with the tokens")]
    # y = r + gate(g) s for a residual r and the shared output s, both unknown: (y(g) - y(0)) / (y(2g) - y(0)) is
    # (sigmoid(g) - 1/2) / (sigmoid(2g) - 1/2) for a sigmoid gate, whatever r and s
    moved, moved2 = y_none - zero, double - zero
    if moved.norm(dim=-1).max().item() <= GATE_TOL * size:
        return out + [Entry("moe.shared_gate", "none", how="zeroing the one-output linear changes no shared output")]
    ratio = (moved * moved2).sum(-1) / (moved2 * moved2).sum(-1).clamp_min(1e-300)
    away = g.abs() > GATE_MIN_LOGIT  # near g = 0 both differences vanish
    want = (torch.sigmoid(g) - 0.5) / (torch.sigmoid(2 * g) - 0.5)
    if away.any() and (ratio - want)[away].abs().max().item() <= GATE_TOL:
        return out + [Entry("moe.shared_gate", "sigmoid", how="the shared output with the gate's logits g made 0 and "
                                                              "2g moves as sigmoid(g) does, g the one-output linear")]
    return out + [Entry("moe.shared_gate", "other", how="the one-output linear scales the shared output, not as a "
                                                        "sigmoid of itself")]


def _gate_linear(probe: Probe, mix: Mixture):
    """A linear inside the mixture with one output per token (a shared expert's gate): its module and its outputs,
    read from a capture of the mixture alone."""
    from tblock_cli.card.probe import Capture

    cap = Capture(probe.module)
    try:
        with train_mode(probe.module, False), torch.no_grad(), cap:
            mix()
    finally:
        cap.close()
    for c in cap.named("linear"):
        if c.weight is not None and isinstance(c.out, torch.Tensor) and c.out.shape[-1] == 1:
            return probe.module.get_submodule(c.weight.rpartition(".")[0]), c.out
    return None
