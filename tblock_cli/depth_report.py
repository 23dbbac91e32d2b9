"""What happens through a stack of N blocks: activation scale, gradients, residual gain, norm placement."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli.config import BlockConfig
from tblock_cli.errors import USER_ERRORS, reraise_as_measure_error
from tblock_cli.probes import f64, residual_gain
from tblock_cli.report import Finding, RunInfo, Status, failing_of

# A Post-LN layer ends in LayerNorm: at the default affine init (weight 1, bias 0) every output
# token has mean 0 and (biased) std sqrt(var / (var + eps)) ~ 1. A Pre-LN layer's output is x + f(...),
# whose per-token std is never that close to 1 by chance. These bounds separate the two with room.
POST_MEAN_MAX = 1e-3  # largest mean |per-token mean| of a normalised output
POST_STD_DEV_MAX = 1e-2  # largest |per-token std - 1| of a normalised output


@dataclass(frozen=True)
class LayerStats:
    index: int
    placement: str  # "pre" or "post", detected from the output, not read from the config
    act_rms: float  # per-token RMS of the layer's output, averaged over tokens
    grad_input_norm: float  # ||d loss / d (layer input)||
    grad_param_norm: float  # ||d loss / d (layer parameters)||
    residual_gain: float  # tr(J)/n of the layer alone, as in check `residual`
    token_mean: float  # mean |per-token mean| of the output (placement evidence)
    token_std_dev: float  # max |per-token std - 1| of the output (placement evidence)


@dataclass(frozen=True)
class DepthReport:
    subject: str
    norm: str  # what was asked: pre | post | mixed | user
    layers: tuple[LayerStats, ...]
    final_norm: bool  # whether a final LayerNorm was applied after the last layer
    final_rms: float | None  # per-token RMS after the final LayerNorm
    input_rms: float
    findings: tuple[Finding, ...]
    strict: bool
    run: RunInfo | None = None

    @property
    def failing(self) -> tuple[Finding, ...]:
        return failing_of(self.findings, self.strict)

    @property
    def ok(self) -> bool:
        return not self.failing

    def body(self) -> dict:
        return {"norm": self.norm, "layers": self.layers, "final_norm": self.final_norm, "final_rms": self.final_rms,
                "input_rms": self.input_rms, "findings": self.findings}

    def to_dict(self) -> dict:
        return (self.run or RunInfo(self.subject, {}, {})).envelope("depth", self.ok, self.body())


@dataclass(frozen=True)
class DepthComparison:
    """depth --compare: pre, post and mixed stacks of the same depth."""

    reports: tuple[DepthReport, ...]

    @property
    def failing(self) -> tuple[Finding, ...]:
        return tuple(f for r in self.reports for f in r.failing)

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(f for r in self.reports for f in r.findings)

    @property
    def run(self) -> RunInfo | None:
        return self.reports[0].run

    def to_dict(self) -> dict:
        run = self.run or RunInfo("", {}, {})
        run = RunInfo("built-in pre, post and mixed stacks", {**run.config, "norm": "compare"}, run.environment, run.warnings)
        return run.envelope("depth", self.ok, {"compare": [{"subject": r.subject, **r.body()} for r in self.reports]})


def detect_placement(out: torch.Tensor) -> tuple[str, float, float]:
    """post when every output token is normalised (mean ~ 0, std ~ 1), else pre."""
    o = f64(out)
    mean = o.mean(-1).abs().mean().item()
    std_dev = (o.std(-1, unbiased=False) - 1).abs().max().item()
    return ("post" if mean < POST_MEAN_MAX and std_dev < POST_STD_DEV_MAX else "pre"), mean, std_dev


def token_rms(t: torch.Tensor) -> float:
    return f64(t).pow(2).mean(-1).sqrt().mean().item()


def measure_stack(layers: list[Callable[[torch.Tensor], torch.Tensor]], modules: list[nn.Module], x: torch.Tensor,
                  final_norm: Callable[[str], nn.Module | None], gen: torch.Generator):
    """Forward through the layers, keeping each layer's input and output; then one backward.

    final_norm(placement of the last layer) gives the LayerNorm to append, or None. The loss is a
    fixed random projection of the output, averaged over tokens: a scalar whose gradient reaches every
    layer (sum() would be blind through a final LayerNorm, whose outputs sum to a constant).
    """
    for m in modules:
        m.eval()  # dropout off: the numbers repeat run to run
        m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    ins, outs, h = [], [], x
    with torch.enable_grad():
        for layer in layers:
            h.retain_grad()
            ins.append(h)
            h = layer(h)
            outs.append(h)
        placements = [detect_placement(o) for o in outs]
        final = final_norm(placements[-1][0])
        y = final(h) if final is not None else h
        w = torch.randn(y.shape, generator=gen).to(device=y.device, dtype=y.dtype)
        loss = (y * w).sum() / (y.shape[0] * y.shape[1])
        loss.backward()
    stats = []
    for i, (layer, module) in enumerate(zip(layers, modules)):
        grads = [f64(p.grad).pow(2).sum() for p in module.parameters() if p.grad is not None]
        gain = residual_gain(layer, ins[i].detach(), gen)
        placement, mean, std_dev = placements[i]
        stats.append(LayerStats(i, placement, token_rms(outs[i]), f64(ins[i].grad).norm().item(),
                                math.sqrt(sum(g.item() for g in grads)), gain, mean, std_dev))
    final_rms = token_rms(y) if final is not None else None
    for m in modules:
        m.zero_grad(set_to_none=True)
    return stats, final is not None, final_rms, token_rms(x)


def depth_findings(stats: list[LayerStats], final_applied: bool, final_rms: float | None, input_rms: float) -> list[Finding]:
    """What the measured numbers say, as data (the words are in messages/reports.py)."""
    out: list[Finding] = []
    n = len(stats)
    first, last = stats[0], stats[-1]
    growth = last.act_rms / input_rms
    out.append(Finding(Status.INFO, "depth.activations", {"input_rms": input_rms, "first": first.act_rms, "last": last.act_rms,
                                                          "last_index": n - 1, "layers": n, "growth": growth,
                                                          "per_layer": growth ** (1 / n)}))
    if final_applied:
        out.append(Finding(Status.INFO, "depth.final_norm", {"before": last.act_rms, "after": final_rms}))
    elif last.placement == "pre" and n > 1:
        out.append(Finding(Status.WARN, "depth.no_final_norm", {"rms": last.act_rms}))
    ratio = first.grad_input_norm / last.grad_input_norm if last.grad_input_norm else float("inf")
    out.append(Finding(Status.INFO, "depth.gradient", {"ratio": ratio, "first": first.grad_input_norm, "last": last.grad_input_norm}))
    pr = [s.grad_param_norm for s in stats]
    out.append(Finding(Status.INFO, "depth.param_gradients", {"min": min(pr), "max": max(pr),
                                                              "ratio": pr[0] / pr[-1] if pr[-1] else float("inf")}))
    gains = [s.residual_gain for s in stats]
    out.append(Finding(Status.INFO, "depth.residual_gains", {"min": min(gains), "max": max(gains)}))
    changes = [s.index for prev, s in zip(stats, stats[1:]) if s.placement != prev.placement]
    if changes:
        out.append(Finding(Status.WARN, "depth.mixed_placement", {"placements": sorted({s.placement for s in stats}),
                                                                   "changes": changes}))
    return out


def run_depth(cfg: BlockConfig, device: torch.device, dtype: torch.dtype,
              make_layers: Callable[[int], list] | None = None, *, strict: bool = False, run: RunInfo | None = None) -> DepthReport:
    """Build N blocks (built-in with cfg.norm, or make_layers(N) of a user block) and measure them."""
    gen = torch.Generator().manual_seed(cfg.seed)
    if make_layers is None:
        from tblock_cli.subject.builtin import build_block

        stack = build_block(cfg, device, dtype)
        blocks = list(stack.layers) if hasattr(stack, "layers") else [stack]
        layers: list = list(blocks)
        fixed_final = getattr(stack, "final_ln", None)
        name = f"built-in {cfg.norm}-LN stack x{cfg.layers}"

        def final_norm(_last_placement):
            return fixed_final
    else:
        subjects = make_layers(cfg.layers)
        blocks, layers = [s.module for s in subjects], subjects
        name = f"{subjects[0].name} x{cfg.layers}"
        torch.manual_seed(cfg.seed)
        ln = nn.LayerNorm(cfg.d_model, eps=cfg.eps).to(device=device, dtype=dtype)

        def final_norm(last_placement):  # same rule as the built-in Stack: only after a Pre-LN layer
            return ln if cfg.final_norm and last_placement == "pre" else None
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen).to(device=device, dtype=dtype)
    try:
        stats, applied, final_rms, input_rms = measure_stack(layers, blocks, x, final_norm, gen)
    except USER_ERRORS as e:  # the block under test raised (sys.exit included)
        reraise_as_measure_error(e, f"{name} raised during the forward/backward")
    return DepthReport(name, cfg.norm if make_layers is None else "user", tuple(stats), applied, final_rms, input_rms,
                       tuple(depth_findings(stats, applied, final_rms, input_rms)), strict, run)
