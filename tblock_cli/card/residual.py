"""Spec readers: the residual form (does the FFN read attention's output?) and the gains at each residual add, regressed
per channel on the captured stream and branch outputs (DeepNorm's alpha on the stream, LayerScale on a branch)."""

from __future__ import annotations

import torch

from tblock_cli.card.entries import Entry, skipped
from tblock_cli.card.norms import placement
from tblock_cli.card.probe import Probe
from tblock_cli.card.sublayers import io_of, same_tensor, sublayers
from tblock_cli.probes import parameters_replaced

# The sum at an add is stream * alpha + branch * beta per channel: on correct blocks the least-squares fit leaves
# 1e-15 (float64); a sum that is not such a mix (a gate that depends on the input, another term) leaves O(1).
MIX_TOL = 1e-6
# A gain is one number when every channel's agrees to this (float64: 1e-12); else it is per channel (LayerScale).
CHANNEL_TOL = 1e-6
# The card's tolerance on a gain: correct blocks read 1 to 1e-12 (float64); the smallest real gains are far: DeepNorm's
# alpha (2N)^(1/4) = 1.41 for two layers, LayerScale's init 1e-5..0.1, granite's residual_multiplier 0.22. 1 % lets a
# declaration give three digits (alpha = 1.86 for (2 x 6)^(1/4) = 1.8612).
GAIN_TOL = 1e-2
# form() replaces attention's output projection with random weights this many times a unit-variance map, not zeros:
# zeroing moves the FFN's input by nothing where the projection is zero at init (modded-nanogpt's c_proj, adaLN-zero)
# and by the branch's gain where a LayerScale (1e-5 at init) follows it, both within SAME_TENSOR_TOL of "unchanged".
REPLACED_GAIN = 1e3
# A branch whose output is this small next to the sum adds nothing: its gain is not defined (least squares would read 0).
SILENT_TOL = 1e-12


def form(probe: Probe) -> tuple[str | None, str]:
    """parallel when replacing attention's output projection leaves what the FFN reads unchanged."""
    sub = sublayers(probe)
    attn_out = sub.roles.get("attn.out", ())
    ffn_in = [n for r in ("ffn.in", "ffn.gate") for n in sub.roles.get(r, ())]
    if not attn_out:
        return None, "no attention output projection in the dataflow"
    ffn_in = [n for n in ffn_in if sub.seen.proj_in.get(n) is not None]
    if not ffn_in:
        return None, "no FFN input projection seen"
    first = min(ffn_in, key=list(sub.seen.proj_in).index)
    replaced = [p for n in attn_out for p in sub.params.get(n, ())]
    gen = torch.Generator().manual_seed(0)

    def loud(_n, p):  # random, REPLACED_GAIN times a unit-variance output: neither zero nor near what it was
        fan_in = p.shape[-1] if p.ndim >= 2 else 1
        return (torch.randn(p.shape, generator=gen, dtype=torch.float64) * REPLACED_GAIN / fan_in ** 0.5).to(p)

    with parameters_replaced(dict(probe.module.named_parameters()), replaced, loud):
        again = io_of(probe, {first: sub.params[first]}, (), sub.seen.x)
    before, after = sub.seen.proj_in[first], again.proj_in.get(first)
    if after is None:
        return None, "the FFN's input was not seen again"
    if same_tensor(before, after):
        return "parallel", f"attention's output replaced: {first.rpartition('.')[2]} reads the same input"
    return "sequential", f"attention's output replaced: {first.rpartition('.')[2]} reads another input"


def mix(target: torch.Tensor, parts: list[torch.Tensor]) -> tuple[torch.Tensor, float] | None:
    """Per channel least squares of target (tokens, C) on parts (each (tokens, C)): coefficients (C, parts), residual."""
    if any(p is None or p.shape != target.shape for p in parts) or target.shape[0] <= len(parts):
        return None
    A = torch.stack(parts, -1).transpose(0, 1)  # (C, tokens, parts)
    b = target.transpose(0, 1).unsqueeze(-1)  # (C, tokens, 1)
    coef = torch.linalg.lstsq(A, b).solution  # (C, parts, 1)
    resid = (A @ coef - b).abs().max().item() / max(b.abs().max().item(), 1e-300)
    return coef.squeeze(-1), resid


def gain(c: torch.Tensor) -> tuple[float, bool]:
    """One gain from per-channel coefficients: (value, per_channel). Per channel: their mean."""
    mean = c.mean().item()
    per = (c - mean).abs().max().item() > CHANNEL_TOL * max(abs(mean), 1e-12)
    return float(f"{mean:.10g}"), per


def _branch(sub, role: str, where: str | None) -> torch.Tensor | None:
    """What a branch adds: its output projection's output, or the norm's output where a norm reads it (sandwich, olmo2)."""
    names = sub.roles.get(role, ())
    out = sub.seen.proj_out.get(names[0]) if len(names) == 1 else None
    if out is None or out.shape != sub.seen.x.reshape(-1, sub.seen.x.shape[-1]).shape:  # experts: the layer's output
        group = role.split(".")[0]
        holder = sub.holder(group)
        others = [n for r, ns in sub.roles.items() if not r.startswith(group) for n in ns]
        # only a module that holds this branch alone (a decoder layer holding self- and cross-attention holds the FFN too)
        if holder is None or any(n.startswith(holder + ".") for n in others):
            return None
        out = sub.seen.module_out.get(holder)
    for n in sub.norms if where in ("sandwich", "olmo2") else ():
        if same_tensor(sub.seen.norm_in.get(n), out):
            return sub.seen.norm_out[n]
    return out


def adds(probe: Probe, kind: str, where: str) -> list[tuple[str, torch.Tensor, list[torch.Tensor], list[str]]] | str:
    """Each residual add as (what, sum, [stream, branch...], names); a string says why they cannot be found."""
    sub = sublayers(probe)
    s = sub.seen
    x, y = s.x.reshape(-1, s.x.shape[-1]), s.y.reshape(-1, s.y.shape[-1])
    a, f = _branch(sub, "attn.out", where), _branch(sub, "ffn.out", where)
    if len(sub.roles.get("attn.out", ())) > 1:
        return "several attention sublayers (cross-attention, or more than one layer)"
    if a is None or f is None:
        return "attention's or the FFN's output was not seen"
    if f.shape != x.shape or a.shape != x.shape:
        return "a branch's output projection runs on part of the tokens (experts) or at another width"
    last = next((n for n in sub.norms if same_tensor(s.norm_out.get(n), y)), None)
    if where != "post":  # the output (before a final norm) is the stream plus each branch's output, each with its gain
        if last is not None:
            return [("the sum before the final norm", s.norm_in[last], [x, a, f], ["stream", "attn", "ffn"])]
        return [("the block's output", y, [x, a, f], ["stream", "attn", "ffn"])]
    if kind == "parallel":
        return "a post-norm block with a parallel residual"
    first = next((sub.first(n) for n in ("ffn.in", "ffn.gate") if sub.first(n) is not None), None)
    h = s.proj_in.get(first)
    feeding = next((n for n in sub.norms if same_tensor(s.norm_out.get(n), h)), None)
    if feeding is None or last is None:
        return "post-norm: the norms before the FFN and at the output were not found"
    return [("attention's add (before its norm)", s.norm_in[feeding], [x, a], ["stream", "attn"]),
            ("the FFN's add (before its norm)", s.norm_in[last], [h, f], ["stream", "ffn"])]


def read(probe: Probe) -> list[Entry]:
    keys = ("residual.stream_gain", "residual.attn_gain", "residual.ffn_gain")
    kind, why = form(probe)
    out = [Entry("residual.form", kind, why) if kind else skipped("residual.form", why)]
    if kind is None:
        return out + [skipped(k, why) for k in keys]
    where, _ = placement(probe)
    found = adds(probe, kind, where)
    if isinstance(found, str):
        return out + [skipped(k, found) for k in keys]
    gains: dict[str, list] = {"stream": [], "attn": [], "ffn": []}
    silent: set[str] = set()  # branches whose output is zero as built: any gain fits them
    for what, total, parts, names in found:
        scale = max(total.abs().max().item(), 1e-300)
        quiet = [n for n, part in zip(names, parts) if part.abs().max().item() <= SILENT_TOL * scale]
        silent.update(quiet)
        if where == "post" and names[-1] in quiet:  # through the norm only the ratio to the branch's gain counts
            return out + [skipped(k, f"{what}: the branch adds zero as built: no ratio to it") for k in keys]
        # a zero column makes the least squares rank-deficient (CUDA's solver then returns NaN): fitted without it
        kept = [i for i, n in enumerate(names) if n not in quiet]
        fitted = mix(total, [parts[i] for i in kept])
        if fitted is None:
            return out + [skipped(k, f"{what}: the sum and its parts differ in shape") for k in keys]
        coef, resid = fitted
        if not resid <= MIX_TOL:
            return out + [skipped(k, f"{what} is not stream x alpha + branch x beta (off by {resid:.1e})") for k in keys]
        read_ = [gain(coef[:, j]) for j in range(len(kept))]
        if where == "post":  # through the norm only the ratio counts: the branch's gain is 1
            b = read_[-1][0]
            if abs(b) < 1e-12:
                return out + [skipped(k, f"{what}: the branch adds nothing (gain {b:.1e})") for k in keys]
            read_ = [(float(f"{g / b:.10g}"), per) for g, per in read_]
        for j, g in zip(kept, read_):
            gains[names[j]].append(g)
    note = " (post-norm: as a ratio to the branch's)" if where == "post" else ""
    for key, n in zip(keys, ("stream", "attn", "ffn")):
        if n in silent:
            out.append(skipped(key, f"the {n} branch adds zero as built (its output projection is zero at init): "
                                    "any gain fits it"))
            continue
        vals = gains[n]
        per = any(p for _, p in vals)
        nums = [v for v, _ in vals]
        value = nums[0] if all(abs(v - nums[0]) <= GAIN_TOL * max(abs(v), abs(nums[0]), 1e-12) for v in nums) else tuple(nums)
        how = f"{found[-1][0]} fitted on the stream and the branches{note}"
        if per:
            how = f"per channel (a LayerScale): their mean; {how}"
        out.append(Entry(key, value, how, tol=GAIN_TOL))
    return out
