"""The check battery: one small function per property of a block, each returning a CheckResult."""

from __future__ import annotations

import copy
import enum
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import anatomy
from tblock_cli.config import BlockConfig
from tblock_cli.loading import Subject, one_line
from tblock_cli.units import fmt_bytes

# Largest |difference| between two computations that should agree, relative to max(1, |reference|).
# float32 sums of a few hundred products carry ~1e-6 relative error; 1e-5 leaves a margin and is
# the tolerance issue #2 sets for the reference check. Half precisions have 10 (fp16) and 7 (bf16)
# mantissa bits: 2^-7 ~ 8e-3 and 2^-4 ~ 6e-2 cover a LayerNorm, an attention and an FFN in a row.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 6e-2}

# Relative RMS error against a float64 copy that is still "agreeing": measured on the built-in
# block at d_model 512 as ~2e-7 (float32), ~5e-4 (float16) and ~4e-3 (bfloat16); 10x margin.
DTYPE_TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}

# Input magnitude for the "large" finite probe: 1e4 in float32; 100 in half precision, whose
# max (65504 fp16) a correct Post-LN block's attention scores would already overflow at 1e3.
LARGE_SCALE = {torch.float64: 1e4, torch.float32: 1e4, torch.float16: 1e2, torch.bfloat16: 1e2}

# tr(J)/n of input -> output. An identity residual contributes exactly 1; the branches' own
# Jacobians are mean-zero at init, so a healthy block measures ~1.0 (Pre-LN) or ~0.9 (Post-LN, the
# LayerNorm after the add divides by the sum's std). A block without a residual measures ~0.
# 0.5 sits halfway, so neither seed nor probe noise (std ~ 1/sqrt(n) per probe) can cross it.
RESIDUAL_MIN = 0.5
RESIDUAL_PROBES = 8

# The FFN-share check warns when parameters outside attention, FFN and norms exceed this share:
# in a standard block only biases could land there, and they are attributed to their layers.
OTHER_SHARE_MAX = 0.01


class Status(str, enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    value: object  # a number, a short string, or None
    detail: str  # one line: what the value means


@dataclass(frozen=True)
class CheckReport:
    checks: tuple[CheckResult, ...]
    strict: bool

    @property
    def ok(self) -> bool:
        bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if self.strict else set())
        return not any(c.status in bad for c in self.checks)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status == s for c in self.checks) for s in Status}


@dataclass
class Context:
    """The subject and what every check draws on: sizes, dtype, a seeded generator."""

    subject: Subject
    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    gen: torch.Generator = field(init=False)
    shape_ok: bool = True
    backward: tuple | None = None  # (x.grad, {name: grad}) of one train-mode backward, once computed

    def __post_init__(self):
        self.gen = torch.Generator().manual_seed(self.cfg.seed)

    @property
    def tol(self) -> float:
        return TOLERANCE[self.dtype]

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen) * scale
        return x.to(device=self.device, dtype=self.dtype)

    def x(self, batch: int | None = None, seq: int | None = None) -> torch.Tensor:
        return self.randn(batch or self.cfg.batch, seq or self.cfg.seq, self.cfg.d_model)


@contextmanager
def mode(module: nn.Module, train: bool):
    """Put the module in train or eval mode for a while; restore what it was."""
    was = module.training
    module.train(train)
    try:
        yield
    finally:
        module.train(was)


def f64(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy on the CPU, where every comparison is made (MPS has no float64)."""
    return t.detach().to(device="cpu", dtype=torch.float64)


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max|a - ref| / max(1, max|ref|), in float64; inf if either is not finite."""
    a, ref = f64(a), f64(ref)
    if not (torch.isfinite(a).all() and torch.isfinite(ref).all()):
        return float("inf")
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    return (a - ref).abs().max().item() / scale if a.numel() else 0.0


def eval_forward(ctx: Context, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
    with mode(ctx.subject.module, False), torch.no_grad():
        return ctx.subject(x.clone(), pad_mask)  # a clone: a block that mutates its input spoils no other check


def projected(ctx: Context, part: torch.Tensor) -> torch.Tensor:
    """A scalar loss from part of an output: its dot product with a fresh random tensor of its shape."""
    return (part.float() * ctx.randn(*part.shape).float()).sum()


def input_grad(ctx: Context, x: torch.Tensor, loss_of: Callable, train: bool = True, pad_mask=None) -> torch.Tensor | None:
    """d loss_of(out) / d x, in train (or eval) mode with grad enabled."""
    x = x.detach().clone().requires_grad_(True)
    with mode(ctx.subject.module, train), torch.enable_grad():
        out = ctx.subject(x.clone(), pad_mask)
        loss = loss_of(out)
        if not loss.requires_grad:
            return None
        (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return g


# --------------------------------------------------------------------------- the checks


def check_shape(ctx: Context) -> CheckResult:
    B, T = ctx.cfg.batch, ctx.cfg.seq
    if B == T:
        T += 1  # a (T, B) mix-up cannot show when B == T
    x = ctx.x(B, T)
    out = eval_forward(ctx, x)
    ctx.shape_ok = out.shape == x.shape
    if ctx.shape_ok:
        return CheckResult("shape", Status.PASS, list(out.shape), "output keeps the input's shape (B, T, d)")
    return CheckResult("shape", Status.FAIL, list(out.shape), f"input {tuple(x.shape)} came out as {tuple(out.shape)}")


def check_finite(ctx: Context) -> CheckResult:
    B, T, d = ctx.cfg.batch, ctx.cfg.seq, ctx.cfg.d_model
    scale = LARGE_SCALE[ctx.dtype]
    inputs = {
        "random": ctx.x(),
        "constant-token": ctx.randn(B, T, 1).expand(B, T, d).contiguous(),  # zero variance per token
        "zero": torch.zeros(B, T, d, device=ctx.device, dtype=ctx.dtype),
        f"x{scale:g}": ctx.x() * scale,
    }
    bad = []
    for label, x in inputs.items():
        out = eval_forward(ctx, x)
        if not torch.isfinite(out).all():
            bad.append(f"{label} input gives {_nonfinite_kind(out)}")
    # Each norm alone on a zero-variance input: eps = 0 there is 0/0 whatever the block around it does.
    for name, norm in anatomy.norm_modules(ctx.subject.module):
        if norm.eps > 0:
            continue
        try:
            with torch.no_grad():
                out = norm(torch.zeros(1, 2, d, device=ctx.device, dtype=ctx.dtype))
        except Exception:  # noqa: BLE001 - a norm over another shape; the block-level probes still ran
            continue
        if not torch.isfinite(out).all():
            bad.append(f"{name} ({type(norm).__name__}, eps={norm.eps:g}) gives NaN on a zero-variance input")
    if bad:
        return CheckResult("finite", Status.FAIL, len(bad), "; ".join(bad))
    return CheckResult("finite", Status.PASS, len(inputs), f"outputs finite on {', '.join(inputs)} inputs")


def _nonfinite_kind(t: torch.Tensor) -> str:
    kinds = [k for k, present in (("NaN", torch.isnan(t).any()), ("inf", torch.isinf(t).any())) if present]
    return "/".join(kinds) or "non-finite values"


def _train_backward(ctx: Context) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """One train-mode backward of a random projection of the output; grads of x and of each parameter.

    Computed once and shared by grad_input and grad_params.
    """
    if ctx.backward is None:
        ctx.backward = _run_train_backward(ctx)
    return ctx.backward


def _run_train_backward(ctx: Context) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    module = ctx.subject.module
    x = ctx.x().requires_grad_(True)
    saved = {n: p.grad for n, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    try:
        with mode(module, True), torch.enable_grad():
            out = ctx.subject(x.clone())
            # a random projection: out.sum() would see nothing through a final LayerNorm
            w = torch.randn(out.shape, generator=ctx.gen).to(out.device)
            loss = (out.float() * w).sum()
            loss.backward()
        grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    finally:
        for n, p in module.named_parameters():
            p.grad = saved[n]
    return x.grad, grads


def check_grad_input(ctx: Context) -> CheckResult:
    g, _ = _train_backward(ctx)
    if g is None:
        return CheckResult("grad_input", Status.FAIL, None, "no gradient reaches x: the output is cut off from the input (detach? no_grad?)")
    if not torch.isfinite(g).all():
        return CheckResult("grad_input", Status.FAIL, _nonfinite_kind(g), "the gradient at x is not finite")
    norm = f64(g).norm().item()
    if norm == 0:
        return CheckResult("grad_input", Status.FAIL, 0.0, "the gradient at x is exactly zero")
    return CheckResult("grad_input", Status.PASS, norm, "a loss's gradient reaches x: finite, non-zero (value: its norm)")


def check_grad_params(ctx: Context) -> CheckResult:
    _, grads = _train_backward(ctx)
    if not grads:
        return CheckResult("grad_params", Status.SKIP, 0, "the block has no trainable parameters")
    missing = [n for n, g in grads.items() if g is None]
    nonfinite = [n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    zero = [n for n, g in grads.items() if g is not None and torch.isfinite(g).all() and not g.any()]
    got = len(grads) - len(missing)
    value = f"{got}/{len(grads)}"
    if missing:
        return CheckResult("grad_params", Status.FAIL, value, f"no gradient (defined but unused, or run under no_grad): {', '.join(missing)}")
    if nonfinite:
        return CheckResult("grad_params", Status.FAIL, value, f"non-finite gradient: {', '.join(nonfinite)}")
    note = f"; exactly zero (can be legitimate, e.g. a key bias): {', '.join(zero)}" if zero else ""
    return CheckResult("grad_params", Status.PASS, value, f"every trainable parameter gets a finite gradient{note}")


def residual_gain(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, gen: torch.Generator, probes: int = RESIDUAL_PROBES) -> float:
    """tr(J)/n of x -> f(x), from Rademacher probes v: E[v . (J^T v)] = tr(J)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = f(x.clone())
        if out.shape != x.shape:
            raise ValueError(f"output shape {tuple(out.shape)} differs from the input's {tuple(x.shape)}")
        total = 0.0
        for k in range(probes):
            v = (torch.randint(0, 2, out.shape, generator=gen) * 2 - 1).to(device=out.device, dtype=out.dtype)
            (g,) = torch.autograd.grad(out, x, v, retain_graph=k < probes - 1, allow_unused=True)
            if g is None:
                return 0.0
            total += (f64(v) * f64(g)).sum().item()
    return total / probes / x.numel()


def layer_inputs(layers: list[nn.Module], run: Callable[[], object]) -> list[torch.Tensor]:
    """The input each layer saw during run(), captured with forward pre-hooks."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach())) for layer in layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def check_residual(ctx: Context) -> CheckResult:
    module, x = ctx.subject.module, ctx.x()
    with mode(module, False):
        layers = list(getattr(module, "layers", [])) if ctx.subject.builtin else []
        if layers:
            inputs = layer_inputs(layers, lambda: eval_forward(ctx, x))
            gains = [residual_gain(layer, inp, ctx.gen) for layer, inp in zip(layers, inputs)]
        else:
            gains = [residual_gain(ctx.subject, x, ctx.gen)]
    worst = min(range(len(gains)), key=gains.__getitem__)
    shown = ", ".join(f"{g:.3f}" for g in gains)
    where = f"layer {worst}: " if len(gains) > 1 else ""
    if gains[worst] < RESIDUAL_MIN:
        return CheckResult("residual", Status.FAIL, round(gains[worst], 4),
                           f"{where}tr(J)/n = {gains[worst]:.3f} < {RESIDUAL_MIN}: no identity path from input to output (missing x + ...?)")
    return CheckResult("residual", Status.PASS, round(gains[worst], 4),
                       f"tr(J)/n = {shown}: identity path present (Pre-LN ~1, Post-LN ~0.9, none ~0)")


def check_batch(ctx: Context) -> CheckResult:
    B = max(2, ctx.cfg.batch)
    x = ctx.x(B)
    out = eval_forward(ctx, x)
    worst = max(rel_diff(eval_forward(ctx, x[i : i + 1])[0], out[i]) for i in range(B))
    if worst > ctx.tol:
        return CheckResult("batch", Status.FAIL, worst, f"a sample alone differs from itself in the batch by {worst:.2e} (> {ctx.tol:g}): samples leak (eval)")
    # Train mode too (dropout, batch statistics): sample 0's output must not depend on the others.
    g = input_grad(ctx, x, lambda out: projected(ctx, out[0]))
    if g is not None and g[1:].any():
        leak = f64(g[1:]).abs().max().item()
        return CheckResult("batch", Status.FAIL, leak, f"in train mode sample 0's output has gradient {leak:.2e} w.r.t. other samples: samples leak")
    return CheckResult("batch", Status.PASS, worst, f"a sample alone = its output in the batch (max rel. diff {worst:.1e}); no cross-sample gradient")


def padding_mask(ctx: Context, B: int, T: int) -> torch.Tensor:
    """(B, T) bool, True = padding: sample i keeps its first T - max(1, T // 3) - i tokens (at least 1)."""
    lengths = torch.tensor([max(1, T - max(1, T // 3) - i) for i in range(B)])
    return (torch.arange(T)[None, :] >= lengths[:, None]).to(ctx.device)


def check_padding(ctx: Context) -> CheckResult:
    if ctx.subject.pad_keyword is None:
        return CheckResult("padding", Status.SKIP, None, "the forward takes none of pad_mask, key_padding_mask, src_key_padding_mask")
    B, T = ctx.cfg.batch, max(ctx.cfg.seq, 3)
    x = ctx.x(B, T)
    mask = padding_mask(ctx, B, T)
    x2 = x.clone()
    x2[mask] = ctx.randn(int(mask.sum()), ctx.cfg.d_model, scale=3.0)
    keep = ~mask
    diff = rel_diff(eval_forward(ctx, x2, mask)[keep], eval_forward(ctx, x, mask)[keep])
    full = _fully_padded(ctx, x, T)
    if diff > ctx.tol:
        return CheckResult("padding", Status.FAIL, diff, f"changing padded inputs moved unpadded outputs by {diff:.2e}: the mask is ignored or inverted; {full}")
    g = input_grad(ctx, x, lambda out: projected(ctx, out[keep]), pad_mask=mask)
    if g is not None and g[mask].any():
        return CheckResult("padding", Status.FAIL, f64(g[mask]).abs().max().item(),
                           f"in train mode unpadded outputs have a gradient w.r.t. padded inputs; {full}")
    return CheckResult("padding", Status.PASS, diff, f"padded inputs reach no unpadded output; {full}")


def _fully_padded(ctx: Context, x: torch.Tensor, T: int) -> str:
    """What a sequence whose every key is padding produces: information, PyTorch's paths differ."""
    mask = torch.zeros(x.shape[0], T, dtype=torch.bool, device=ctx.device)
    mask[0] = True
    try:
        out = eval_forward(ctx, x, mask)[0]
    except Exception as e:  # noqa: BLE001
        return f"a fully padded sequence raises {one_line(e)}"
    if torch.isnan(out).any():
        what = "NaN" if torch.isnan(out).all() else "some NaN"
    elif not out.any():
        what = "zeros"
    else:
        what = "finite values"
    return f"a fully padded row gives {what} (eval)"


def future_grad(ctx: Context, x: torch.Tensor, t: int, train: bool) -> torch.Tensor | None:
    """Gradient of the outputs up to t w.r.t. the inputs after t: exactly zero in a causal block."""
    g = input_grad(ctx, x, lambda o: projected(ctx, o[:, : t + 1]), train=train)
    return None if g is None else g[:, t + 1 :]


def check_causal(ctx: Context) -> CheckResult:
    T = max(ctx.cfg.seq, 3)
    x = ctx.x(seq=T)
    if not ctx.cfg.causal:  # not asked for; say what the block does, as information
        g = future_grad(ctx, x, T // 2, train=False)
        seen = "outputs depend on later positions" if g is not None and g.any() else "outputs ignore later positions already"
        return CheckResult("causal", Status.SKIP, None, f"not asked for (--causal); {seen}")
    out = eval_forward(ctx, x)
    worst, worst_t = 0.0, None
    for t in sorted({0, T // 2, T - 2}):
        x2 = x.clone()
        x2[:, t + 1 :] = ctx.randn(x.shape[0], T - t - 1, ctx.cfg.d_model, scale=3.0)
        diff = rel_diff(eval_forward(ctx, x2)[:, : t + 1], out[:, : t + 1])
        if diff > worst:
            worst, worst_t = diff, t
    if worst > ctx.tol:
        return CheckResult("causal", Status.FAIL, worst, f"changing positions after t={worst_t} moved outputs up to t by {worst:.2e}: the future leaks")
    t = T // 2
    g = future_grad(ctx, x, t, train=True)
    if g is not None and g.any():
        return CheckResult("causal", Status.FAIL, f64(g).abs().max().item(),
                           f"in train mode outputs up to t={t} have a gradient w.r.t. later positions: the future leaks")
    return CheckResult("causal", Status.PASS, worst, "outputs up to t ignore inputs after t (values and gradients)")


def check_determinism(ctx: Context) -> CheckResult:
    x = ctx.x()
    a, b = eval_forward(ctx, x), eval_forward(ctx, x)
    if torch.equal(a, b):
        return CheckResult("determinism", Status.PASS, 0.0, "two eval forwards are bit-identical")
    diff = rel_diff(a, b)
    if diff <= ctx.tol:
        return CheckResult("determinism", Status.WARN, diff, f"two eval forwards differ by {diff:.1e}, within rounding: non-deterministic kernels")
    return CheckResult("determinism", Status.FAIL, diff, f"two eval forwards differ by {diff:.2e}: randomness in eval (dropout left on? F.dropout(training=True)?)")


def check_input_unchanged(ctx: Context) -> CheckResult:
    x = ctx.x()
    before = x.clone()
    with mode(ctx.subject.module, False), torch.no_grad():
        ctx.subject(x)
    if not torch.equal(x, before):
        return CheckResult("input_unchanged", Status.FAIL, rel_diff(x, before), "an eval forward changed the caller's tensor in place")
    with mode(ctx.subject.module, True), torch.enable_grad():
        ctx.subject(x)
    if not torch.equal(x, before):
        return CheckResult("input_unchanged", Status.FAIL, rel_diff(x, before), "a train forward changed the caller's tensor in place")
    return CheckResult("input_unchanged", Status.PASS, 0.0, "caller's tensor unchanged by eval and train forwards")


def check_need_weights(ctx: Context) -> CheckResult:
    mhas = anatomy.attention_modules(ctx.subject.module)
    if not mhas:
        return CheckResult("need_weights", Status.SKIP, None, "no nn.MultiheadAttention inside; need_weights is its option")
    calls: list[tuple[str, bool, int]] = []

    def recorder(name):
        def hook(mha, args, kwargs):
            bound = anatomy.mha_call_arguments(mha, args, kwargs)
            calls.append((name, bool(bound.arguments["need_weights"]), anatomy.attention_weights_bytes(mha, bound)))
        return hook

    hooks = [m.register_forward_pre_hook(recorder(n), with_kwargs=True) for n, m in mhas]
    try:
        eval_forward(ctx, ctx.x())
    finally:
        for h in hooks:
            h.remove()
    if not calls:
        return CheckResult("need_weights", Status.SKIP, None, "no nn.MultiheadAttention was called in the forward")
    on = [(n, b) for n, nw, b in calls if nw]
    if on:
        wasted = sum(b for _, b in on)
        names = ", ".join(sorted({n or "(root)" for n, _ in on}))
        return CheckResult("need_weights", Status.WARN, wasted,
                           f"{names} called with need_weights=True: {fmt_bytes(wasted)} of attention weights computed and thrown away per forward; pass need_weights=False")
    return CheckResult("need_weights", Status.PASS, 0, f"{len(calls)} nn.MultiheadAttention call(s), all need_weights=False")


def check_dtype(ctx: Context) -> CheckResult:
    module = ctx.subject.module
    ref_device = ctx.device if ctx.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    x = ctx.x()
    out = eval_forward(ctx, x)
    ref_module = copy.deepcopy(module).to(device=ref_device, dtype=torch.float64)
    ref_subject = type(ctx.subject)(ref_module, ctx.subject.name, ctx.subject.builtin, ctx.subject.pad_keyword, ctx.subject.causal)
    with mode(ref_module, False), torch.no_grad():
        ref = ref_subject(x.to(device=ref_device, dtype=torch.float64))
    del ref_module
    name = str(ctx.dtype).replace("torch.", "")
    if not torch.isfinite(out).all():
        return CheckResult("dtype", Status.FAIL, None, f"{name} output is not finite where float64 is" if torch.isfinite(ref).all() else "not finite in float64 either")
    err = ((f64(out) - f64(ref)).norm() / f64(ref).norm().clamp_min(1e-30)).item()
    limit = DTYPE_TOLERANCE[ctx.dtype]
    if err > limit:
        return CheckResult("dtype", Status.FAIL, err, f"{name} differs from a float64 copy by relative RMS {err:.2e} > {limit:g}")
    return CheckResult("dtype", Status.PASS, err, f"{name} vs a float64 copy: relative RMS error (limit {limit:g})")


def check_ffn_share(ctx: Context) -> CheckResult:
    module = ctx.subject.module
    total = sum(p.numel() for p in module.parameters())
    counts = anatomy.group_counts(module)
    if not counts["ffn"] or not total:
        return CheckResult("ffn_share", Status.SKIP, None, "no FFN recognised (Linear layers outside attention)")
    share = counts["ffn"] / total
    mats = anatomy.matrix_counts(module)
    ratio_attn = mats["ffn"] / mats["attention"] if mats["attention"] else float("inf")
    predicted = anatomy.predicted_ffn_share(mats)
    other = counts["other"] / total
    why = "the 2/3 rule" if abs(predicted - 2 / 3) < 5e-4 else f"FFN/attention matrices = {ratio_attn:.2f}, not 2"
    detail = f"FFN share; matrices predict {predicted:.1%} ({why}); biases and norms {(share - predicted) * 100:+.1f} pt"
    if other > OTHER_SHARE_MAX:
        return CheckResult("ffn_share", Status.WARN, round(share, 4), f"{detail}; {other:.1%} of parameters sit outside attention, FFN and norms")
    return CheckResult("ffn_share", Status.PASS, round(share, 4), detail)


def check_reference(ctx: Context) -> CheckResult:
    if not ctx.subject.builtin:
        return CheckResult("reference", Status.SKIP, None, "needs the built-in block's structure; a user block has no reference")
    from tblock_cli.reference import reference_output

    x = ctx.x().float()
    module = copy.deepcopy(ctx.subject.module).float()
    with mode(module, False), torch.no_grad():
        ours = module(x)
        theirs = reference_output(module, ctx.cfg, x)
    diff = (ours - theirs).abs().max().item()
    if not diff <= 1e-5:
        return CheckResult("reference", Status.FAIL, diff, f"differs from nn.TransformerEncoderLayer with the same weights by {diff:.2e} (> 1e-5, float32)")
    return CheckResult("reference", Status.PASS, diff, "max |diff| to nn.TransformerEncoderLayer with copied weights (float32, eval)")


BATTERY: tuple[Callable[[Context], CheckResult], ...] = (
    check_shape,
    check_finite,
    check_grad_input,
    check_grad_params,
    check_residual,
    check_batch,
    check_padding,
    check_causal,
    check_determinism,
    check_input_unchanged,
    check_need_weights,
    check_dtype,
    check_ffn_share,
    check_reference,
)
# Checks that index the output by the input's positions: meaningless once `shape` has failed.
SHAPE_DEPENDENT = {"residual", "batch", "padding", "causal", "dtype", "reference"}
CHECK_NAMES = tuple(f.__name__.removeprefix("check_") for f in BATTERY)


def run_checks(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *,
               strict: bool = False, progress: Callable[[str], None] | None = None) -> CheckReport:
    """Run the whole battery; a check that raises becomes `error` and the rest still run."""
    ctx = Context(subject, cfg, device, dtype)
    results = []
    for check in BATTERY:
        name = check.__name__.removeprefix("check_")
        if progress:
            progress(name)
        if not ctx.shape_ok and name in SHAPE_DEPENDENT:
            results.append(CheckResult(name, Status.SKIP, None, "needs an output of the input's shape (see shape)"))
            continue
        try:
            results.append(check(ctx))
        except Exception as e:  # noqa: BLE001 - the block under test raised; report it, go on
            results.append(CheckResult(name, Status.ERROR, None, one_line(e)))
    return CheckReport(tuple(results), strict)
