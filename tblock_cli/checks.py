"""The check battery: one small function per property of a block, declared once in a registry with what it needs."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from tblock_cli import anatomy
from tblock_cli.config import BlockConfig
from tblock_cli.errors import is_out_of_memory
from tblock_cli.loading import Subject, one_line
from tblock_cli.probes import f64, rel_diff, residual_gain, train_mode
from tblock_cli.report import RunInfo, Status
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
# A gain near 2 counts the identity twice (x + x + f(x)); no correct block measured above 1.01.
RESIDUAL_MAX = 1.5

# The FFN-share check warns when parameters outside attention, FFN and norms exceed this share:
# in a standard block only biases could land there, and they are attributed to their layers.
OTHER_SHARE_MAX = 0.01

# Attention logits' std against what q.k/sqrt(d_head) predicts from the projections' outputs:
# ~1 when scaled (measured 0.96-1.07 on every correct block of the sweep), sqrt(d_head) when the
# 1/sqrt(d_head) is missing (4 at d_head 16, 8 at d_head 64). 2 sits between them on a log scale.
UNSCALED_RATIO = 2.0
# Below this the scores are scaled more than 1/sqrt(d_head): 1/sqrt(d_model) gives 1/sqrt(n_heads)
# (0.5 at 4 heads, 0.35 at 8), the scale applied twice 1/sqrt(d_head) (0.25 at d_head 16). Correct
# blocks measured 0.91 or more. (muP's deliberate 1/d_head scale lands here too: the warning says so.)
OVERSCALED_RATIO = 0.6

# Names that mark position machinery inside a block; token order then matters by design.
# Positions decoded by kv_cache: enough that a window or an off-by-one shows, small enough to be quick.
KV_SEQ = 16

POSITIONAL_NAMES = re.compile(r"rotary|rope|alibi|rel_?pos|relative|pos_?emb|position|inv_freq|sinusoid|wpe|(^|[._])pos([._]|$)", re.I)

# Needs a check can declare; the check that establishes each, and the reason a dependant skips.
NEED_REASON = {
    "shape": "needs an output of the input's shape (see shape)",
    "finite": "outputs not finite (see finite)",
    "deterministic": "outputs random in eval (see determinism): two forwards cannot be compared",
    "input_kept": "the forward changes its input in place (see input_unchanged): gradients through it are unreliable",
    "independent": "samples leak into each other (see batch): a sample alone cannot be compared with its padded batch",
}
# The check whose failure (or error) leaves a need unmet. finite and determinism set theirs inside,
# more narrowly: only a non-finite output of a random input, only a difference beyond rounding.
ESTABLISHES = {"shape": "shape", "input_unchanged": "input_kept", "batch": "independent"}


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
    run: RunInfo | None = None

    @property
    def ok(self) -> bool:
        bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if self.strict else set())
        return not any(c.status in bad for c in self.checks)

    @property
    def failing(self) -> list[CheckResult]:
        bad = {Status.FAIL, Status.ERROR} | ({Status.WARN} if self.strict else set())
        return [c for c in self.checks if c.status in bad]

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status == s for c in self.checks) for s in Status if s is not Status.INFO}

    def to_dict(self) -> dict:
        run = self.run or RunInfo("", {}, {})
        return run.envelope("check", self.ok, {"strict": self.strict, "counts": self.counts(), "checks": self.checks})


@dataclass
class Context:
    """The subject and what every check draws on: sizes, dtype, a seeded generator, shared probes."""

    subject: Subject
    cfg: BlockConfig
    device: torch.device
    dtype: torch.dtype
    gen: torch.Generator = field(init=False)
    unmet: dict = field(default_factory=dict)  # need -> reason, filled as the checks establishing them run
    backward: tuple | None = None  # (x.grad, {name: grad}) of one train-mode backward, once computed
    causal_itself: bool | None = None  # outputs ignore later positions without --causal, once computed
    _dataflow: object = None

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

    def dataflow(self):
        """The block's traced anatomy on the probe input, computed once (ffn_share and attention share it)."""
        if self._dataflow is None:
            from tblock_cli.dataflow import trace

            self._dataflow = trace(self.subject.module, self.subject, self.x(), self.cfg.d_model)
        return self._dataflow


def eval_forward(ctx: Context, x: torch.Tensor, pad_mask: torch.Tensor | None = None, subject: Subject | None = None) -> torch.Tensor:
    s = subject or ctx.subject
    with train_mode(s.module, False), torch.no_grad():
        return s(x.clone(), pad_mask)  # a clone: a block that mutates its input spoils no other check


def projected(ctx: Context, part: torch.Tensor) -> torch.Tensor:
    """A scalar loss from part of an output: its dot product with a fresh random tensor of its shape."""
    return (part.float() * ctx.randn(*part.shape).float()).sum()


def input_grad(ctx: Context, x: torch.Tensor, loss_of: Callable, train: bool = True, pad_mask=None) -> torch.Tensor | None:
    """d loss_of(out) / d x, in train (or eval) mode with grad enabled."""
    x = x.detach().clone().requires_grad_(True)
    with train_mode(ctx.subject.module, train), torch.enable_grad():
        out = ctx.subject(x.clone(), pad_mask)
        loss = loss_of(out)
        if not loss.requires_grad:
            return None
        (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return g


def _nonfinite_kind(t: torch.Tensor) -> str:
    kinds = [k for k, present in (("NaN", torch.isnan(t).any()), ("inf", torch.isinf(t).any())) if present]
    return "/".join(kinds) or "non-finite values"


def by_design(ctx: Context, rule: str) -> str | None:
    """Why the block breaks `rule` on purpose, when its loader knows the family (hf:TYPE sets `by_design`);
    None for any other block, which is then judged by the rule."""
    return getattr(ctx.subject.module, "by_design", {}).get(rule)


# --------------------------------------------------------------------------- the checks
# Each returns (status, value, detail); the runner stamps the name and decides skips.


def check_shape(ctx: Context):
    B, T = ctx.cfg.batch, ctx.cfg.seq
    if B == T:
        T += 1  # a (T, B) mix-up cannot show when B == T
    x = ctx.x(B, T)
    out = eval_forward(ctx, x)
    if out.shape != x.shape:
        return Status.FAIL, list(out.shape), f"input {tuple(x.shape)} came out as {tuple(out.shape)}"
    if out.dtype != x.dtype:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return Status.WARN, list(out.shape), (f"shape kept, but a {name(x.dtype)} input came out as {name(out.dtype)}: something "
                                              f"upcasts (a float64 constant? a softmax kept in float32?), and every later layer pays for it")
    return Status.PASS, list(out.shape), "output keeps the input's shape (B, T, d) and dtype"


def check_finite(ctx: Context):
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
            if label == "random":  # the other checks compare outputs of random inputs: they cannot read these
                ctx.unmet["finite"] = NEED_REASON["finite"]
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
        return Status.FAIL, len(bad), "; ".join(bad)
    return Status.PASS, len(inputs), f"outputs finite on {', '.join(inputs)} inputs"


def check_determinism(ctx: Context):
    x = ctx.x()
    a, b = eval_forward(ctx, x), eval_forward(ctx, x)
    if torch.equal(a, b):
        return Status.PASS, 0.0, "two eval forwards are bit-identical"
    diff = rel_diff(a, b)
    if diff <= ctx.tol:
        return Status.WARN, diff, f"two eval forwards differ by {diff:.1e}, within rounding: non-deterministic kernels"
    ctx.unmet["deterministic"] = NEED_REASON["deterministic"]
    return Status.FAIL, diff, f"two eval forwards differ by {diff:.2e}: randomness in eval (dropout left on? F.dropout(training=True)?)"


def _train_backward(ctx: Context) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """One train-mode backward of a random projection of the output, computed once for grad_input and grad_params."""
    if ctx.backward is None:
        module = ctx.subject.module
        x = ctx.x().requires_grad_(True)
        saved = {n: p.grad for n, p in module.named_parameters()}
        for p in module.parameters():
            p.grad = None
        try:
            with train_mode(module, True), torch.enable_grad():
                out = ctx.subject(x.clone())
                # a random projection: out.sum() would see nothing through a final LayerNorm
                w = torch.randn(out.shape, generator=ctx.gen).to(out.device)
                (out.float() * w).sum().backward()
            grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
        finally:
            for n, p in module.named_parameters():
                p.grad = saved[n]
        ctx.backward = (x.grad, grads)
    return ctx.backward


def check_grad_input(ctx: Context):
    g, _ = _train_backward(ctx)
    if g is None:
        return Status.FAIL, None, "no gradient reaches x: the output is cut off from the input (detach? no_grad?)"
    if not torch.isfinite(g).all():
        return Status.FAIL, _nonfinite_kind(g), "the gradient at x is not finite"
    norm = f64(g).norm().item()
    if norm == 0:
        return Status.FAIL, 0.0, "the gradient at x is exactly zero"
    return Status.PASS, norm, "a loss's gradient reaches x: finite, non-zero (value: its norm)"


def check_grad_params(ctx: Context):
    _, grads = _train_backward(ctx)
    if not grads:
        return Status.SKIP, 0, "the block has no trainable parameters"
    missing = [n for n, g in grads.items() if g is None]
    nonfinite = [n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    zero = [n for n, g in grads.items() if g is not None and torch.isfinite(g).all() and not g.any()]
    value = f"{len(grads) - len(missing)}/{len(grads)}"
    if missing:
        return Status.FAIL, value, f"no gradient (defined but unused, or run under no_grad): {', '.join(missing)}"
    if nonfinite:
        return Status.FAIL, value, f"non-finite gradient: {', '.join(nonfinite)}"
    note = f"; exactly zero (can be legitimate, e.g. a key bias): {', '.join(zero)}" if zero else ""
    return Status.PASS, value, f"every trainable parameter gets a finite gradient{note}"


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


def check_residual(ctx: Context):
    module, x = ctx.subject.module, ctx.x()
    with train_mode(module, False):
        layers = list(getattr(module, "layers", [])) if ctx.subject.builtin else []
        if layers:
            inputs = layer_inputs(layers, lambda: eval_forward(ctx, x))
            gains = [residual_gain(layer, inp, ctx.gen) for layer, inp in zip(layers, inputs)]
        else:
            gains = [residual_gain(ctx.subject, x, ctx.gen)]
    worst = min(range(len(gains)), key=gains.__getitem__)
    shown = ", ".join(f"{g:.3f}" for g in gains)
    where = f"layer {worst}: " if len(gains) > 1 else ""
    if not gains[worst] >= RESIDUAL_MIN:
        return Status.FAIL, round(gains[worst], 4), \
            f"{where}tr(J)/n = {gains[worst]:.3f} < {RESIDUAL_MIN}: no identity path from input to output (missing x + ...?)"
    top = max(range(len(gains)), key=gains.__getitem__)
    if gains[top] > RESIDUAL_MAX:
        where = f"layer {top}: " if len(gains) > 1 else ""
        return Status.FAIL, round(gains[top], 4), \
            f"{where}tr(J)/n = {gains[top]:.3f} > {RESIDUAL_MAX}: the identity path is counted more than once (x + x + f(x)?)"
    # A residual taken after the norm (h = LN(x); x = h + f(h)) still has gain ~1, but then nothing of the
    # input's scale survives: doubling the input leaves the output unchanged. Not asked of a block whose
    # output comes from a norm (Post-LN): with small branches at init it is nearly scale-invariant by design.
    doubled = rel_diff(eval_forward(ctx, 2 * x), eval_forward(ctx, x))
    if doubled <= ctx.tol and not ctx.dataflow().output_normed and by_design(ctx, "residual.after_norm"):
        return Status.PASS, round(gains[worst], 4), f"tr(J)/n = {shown}; the residual starts at a norm {by_design(ctx, 'residual.after_norm')}"
    if doubled <= ctx.tol and not ctx.dataflow().output_normed:
        return Status.FAIL, round(gains[worst], 4), (f"doubling the input changes the output by {doubled:.1e} only: every path "
                                                     f"from the input starts at a norm, so the residual adds LN(x), not x")
    return Status.PASS, round(gains[worst], 4), f"tr(J)/n = {shown}: identity path present (Pre-LN ~1, Post-LN ~0.9, none ~0)"


def check_batch(ctx: Context):
    B = max(2, ctx.cfg.batch)
    x = ctx.x(B)
    out = eval_forward(ctx, x)
    worst = max(rel_diff(eval_forward(ctx, x[i : i + 1])[0], out[i]) for i in range(B))
    if worst > ctx.tol:
        return Status.FAIL, worst, f"a sample alone differs from itself in the batch by {worst:.2e} (> {ctx.tol:g}): samples leak (eval)"
    # Train mode too (dropout, batch statistics): sample 0's output must not depend on the others.
    g = input_grad(ctx, x, lambda out: projected(ctx, out[0]))
    if g is not None and g[1:].any():
        leak = f64(g[1:]).abs().max().item()
        return Status.FAIL, leak, f"in train mode sample 0's output has gradient {leak:.2e} w.r.t. other samples: samples leak"
    return Status.PASS, worst, f"a sample alone = its output in the batch (max rel. diff {worst:.1e}); no cross-sample gradient"


def pad_lengths(B: int, T: int) -> torch.Tensor:
    """Real tokens per sample: sample i keeps T - max(1, T // 3) - i of T (at least 1)."""
    return torch.tensor([max(1, T - max(1, T // 3) - i) for i in range(B)])


def padding_mask(ctx: Context, B: int, T: int, left: bool = False) -> torch.Tensor:
    """(B, T) bool, True = padding: on the right (real tokens first), or on the left."""
    n = pad_lengths(B, T)
    pos = torch.arange(T)[None, :]
    mask = pos < (T - n)[:, None] if left else pos >= n[:, None]
    return mask.to(ctx.device)


def positional_reason(ctx: Context) -> str | None:
    """Why token order may matter here by design: --positional, or position machinery found by name."""
    if ctx.cfg.positional:
        return "--positional declared"
    for name, _ in list(ctx.subject.module.named_modules()) + list(ctx.subject.module.named_parameters()) + \
            list(ctx.subject.module.named_buffers()):
        if name and POSITIONAL_NAMES.search(name):
            return f"position machinery found ({name})"
    return None


def _padded_equals_alone(ctx: Context, x: torch.Tensor, left: bool) -> tuple[float, str | None]:
    """max rel. diff between each sample's real positions in a padded batch and the same tokens run alone."""
    B, T, _ = x.shape
    mask = padding_mask(ctx, B, T, left)
    out = eval_forward(ctx, x, mask)
    worst = 0.0
    for i, n in enumerate(pad_lengths(B, T).tolist()):
        real = slice(T - n, T) if left else slice(0, n)
        alone = eval_forward(ctx, x[i : i + 1, real])[0]
        got = out[i, real]
        if not torch.isfinite(got).all() and torch.isfinite(alone).all():
            return 0.0, f"{'left' if left else 'right'} padding gives {_nonfinite_kind(got)} at real positions (fully masked pad rows spread)"
        worst = max(worst, rel_diff(got, alone))
    return worst, None


def check_padding(ctx: Context):
    if ctx.subject.pad_keyword is None:
        return Status.SKIP, None, "the forward takes none of pad_mask, key_padding_mask, src_key_padding_mask, padding_mask (name yours with --pad-keyword)"
    B, T = max(2, ctx.cfg.batch), max(ctx.cfg.seq, 3)
    x = ctx.x(B, T)
    mask = padding_mask(ctx, B, T)
    x2 = x.clone()
    x2[mask] = ctx.randn(int(mask.sum()), ctx.cfg.d_model, scale=3.0)
    keep = ~mask
    full = _fully_padded(ctx, x, T)
    diff = rel_diff(eval_forward(ctx, x2, mask)[keep], eval_forward(ctx, x, mask)[keep])
    if diff > ctx.tol:
        return Status.FAIL, diff, f"changing padded inputs moved real outputs by {diff:.2e}: the mask is ignored or inverted; {full}"
    g = input_grad(ctx, x, lambda out: projected(ctx, out[keep]), pad_mask=mask)
    if g is not None and g[mask].any():
        return Status.FAIL, f64(g[mask]).abs().max().item(), f"in train mode real outputs have a gradient w.r.t. padded inputs; {full}"
    # Second half: the real positions of a padded batch equal the same real tokens run alone.
    # Left padding too where the block is causal (declared or by itself): right pads come after every real
    # token, so a decoder that ignores its mask cannot show it there. Not with positions inside: left
    # padding moves the real tokens' positions (a model passes position ids for that).
    causal = ctx.cfg.causal or causal_by_itself(ctx, x)
    sides = [False] + ([True] if causal and positional_reason(ctx) is None else [])
    notes = []
    worst = 0.0
    for left in sides:
        eq, note = _padded_equals_alone(ctx, x, left)
        if note:
            notes.append(note + "; not compared")
            continue
        if eq > ctx.tol:
            side = "left" if left else "right"
            why = "the causal block ignores its mask (pads before a token reach it)" if left else \
                "real tokens do not attend as they do alone: mask polarity (--pad-means keep?) or masked queries zeroed"
            return Status.FAIL, eq, f"with {side} padding, real positions differ from the same tokens run alone by {eq:.2e}: {why}"
        worst = max(worst, eq)
    sides_txt = "right and left padding" if len(sides) == 2 else "right padding"
    extra = f"; {'; '.join(notes)}" if notes else ""
    return Status.PASS, worst, f"padded inputs reach no real output; {sides_txt} = tokens run alone (max {worst:.1e}); {full}{extra}"


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


def causal_by_itself(ctx: Context, x: torch.Tensor) -> bool:
    """Whether the block's outputs ignore later positions already (a property of the block: computed once)."""
    if ctx.causal_itself is None:
        g = future_grad(ctx, x, x.shape[1] // 2, train=False)
        ctx.causal_itself = g is None or not g.any()
    return ctx.causal_itself


def check_causal(ctx: Context):
    T = max(ctx.cfg.seq, 3)
    x = ctx.x(seq=T)
    if not ctx.cfg.causal:  # not asked for; say what the block does, as information
        seen = "outputs ignore later positions already" if causal_by_itself(ctx, x) else "outputs depend on later positions"
        return Status.SKIP, None, f"not asked for (--causal); {seen}"
    out = eval_forward(ctx, x)
    worst, worst_t = 0.0, None
    for t in sorted({0, T // 2, T - 2}):
        x2 = x.clone()
        x2[:, t + 1 :] = ctx.randn(x.shape[0], T - t - 1, ctx.cfg.d_model, scale=3.0)
        diff = rel_diff(eval_forward(ctx, x2)[:, : t + 1], out[:, : t + 1])
        if diff > worst:
            worst, worst_t = diff, t
    if worst > ctx.tol:
        return Status.FAIL, worst, f"changing positions after t={worst_t} moved outputs up to t by {worst:.2e}: the future leaks"
    t = T // 2
    g = future_grad(ctx, x, t, train=True)
    if g is not None and g.any():
        return Status.FAIL, f64(g).abs().max().item(), f"in train mode outputs up to t={t} have a gradient w.r.t. later positions: the future leaks"
    return Status.PASS, worst, "outputs up to t ignore inputs after t (values and gradients)"


def check_order(ctx: Context):
    """Self-attention without positions is permutation-equivariant: permuted tokens in, the same outputs permuted out."""
    if ctx.cfg.causal:
        return Status.SKIP, None, "--causal: token order is the point"
    why = positional_reason(ctx)
    if why:
        return Status.SKIP, None, f"{why}: token order matters by design"
    T = max(ctx.cfg.seq, 3)
    x = ctx.x(seq=T)
    if causal_by_itself(ctx, x):
        return Status.SKIP, None, "the block is causal by itself (outputs ignore later positions): token order is the point"
    perm = torch.randperm(T, generator=ctx.gen)
    if torch.equal(perm, torch.arange(T)):
        perm = perm.roll(1)
    perm = perm.to(ctx.device)
    diff = rel_diff(eval_forward(ctx, x[:, perm]), eval_forward(ctx, x)[:, perm])
    if diff > ctx.tol:
        return Status.WARN, diff, (f"permuting the tokens changed the outputs by {diff:.2e}, not just their order: positions are "
                                   f"scrambled (heads merged without transposing back? a roll or shift?) or the block has "
                                   f"positions inside (RoPE, ALiBi, relative bias): then declare --positional")
    return Status.PASS, diff, "permuted tokens in, the same outputs permuted out (no positions inside, none scrambled)"


def zero_dropout(module: nn.Module) -> int:
    """Set every dropout probability inside to 0 (modules, MHA's, float attributes named *drop*); how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p, n = 0.0, n + 1
            continue
        for key, value in list(vars(m).items()):
            if "drop" in key.lower() and isinstance(value, float) and 0 < value < 1:
                setattr(m, key, 0.0)
                n += 1
    return n


def check_train_eval(ctx: Context):
    """With every dropout zeroed, a train-mode forward computes what the eval forward does."""
    module = copy.deepcopy(ctx.subject.module)
    zero_dropout(module)
    twin = ctx.subject.like(module)
    batch_norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    x = ctx.x()

    def train_forward():
        with train_mode(module, True), torch.no_grad():
            for bn in batch_norms:  # batch statistics are the batch check's business, not this one's
                bn.eval()
            return twin(x.clone())

    a, b = train_forward(), train_forward()
    if rel_diff(a, b) > ctx.tol:
        return Status.SKIP, None, "two train forwards differ with every dropout zeroed (a functional dropout with a fixed p?): nothing to compare"
    ev = eval_forward(ctx, x, subject=twin)
    diff = rel_diff(a, ev)
    if diff > ctx.tol:
        return Status.FAIL, diff, (f"with every dropout zeroed, train mode differs from eval by {diff:.2e}: the block computes "
                                   f"another function in eval (an `if not self.training` path?)")
    return Status.PASS, diff, "with dropout zeroed, train and eval forwards agree"


def check_attention(ctx: Context):
    """Per attention call: logit std, entropy relative to uniform, mean max probability; unscaled scores warned."""
    flow = ctx.dataflow()
    if not flow.attention:
        return Status.SKIP, None, "no attention computation seen (nn.MultiheadAttention, SDPA, or a softmax over a product of activations)"
    parts, worst = [], None
    for c in flow.attention:
        ratio = "" if c.scale_ratio is None else f", scale x{c.scale_ratio:.2f}"
        parts.append(f"{c.where or 'root'} ({c.kind}, d_head {c.head_dim}): logit std {c.logit_std:.3f}, entropy {c.entropy:.2f} "
                     f"of uniform, max p {c.max_prob:.2f}{ratio}")
        if c.scale_ratio is not None and (worst is None or c.scale_ratio > worst.scale_ratio):
            worst = c
    value = None if worst is None else round(worst.scale_ratio, 3)
    if len(parts) > 3:  # a stack: the ranges, not one clause per layer
        calls = flow.attention
        span = lambda vals, f: f"{min(vals):{f}}-{max(vals):{f}}"  # noqa: E731
        ratios = [c.scale_ratio for c in calls if c.scale_ratio is not None]
        parts = [f"{len(calls)} attention calls: logit std {span([c.logit_std for c in calls], '.3f')}, entropy "
                 f"{span([c.entropy for c in calls], '.2f')} of uniform, max p {span([c.max_prob for c in calls], '.2f')}"
                 + (f", scale x{span(ratios, '.2f')}" if ratios else "")]
    wrong_axis = next((c for c in flow.attention if not c.key_axis), None)
    if wrong_axis is not None:
        return Status.FAIL, value, (f"softmax over the query axis in {wrong_axis.where or 'root'}: each key's weights sum to 1, "
                                    f"not each query's (softmax(dim=-2)?); " + "; ".join(parts))
    raw = next((c for c in flow.attention if not c.normalised), None)
    if raw is not None and by_design(ctx, "attention.no_softmax"):
        return Status.PASS, value, f"no softmax in {raw.where or 'root'} {by_design(ctx, 'attention.no_softmax')}; " + "; ".join(parts)
    if raw is not None:
        return Status.WARN, value, (f"no softmax in {raw.where or 'root'}: a q.k product weights the values directly (rows not "
                                    f"non-negative summing to 1; linear attention does this by design); " + "; ".join(parts))
    blind = next((c for c in flow.attention if c.self_masked), None)
    if blind is not None:
        return Status.WARN, value, (f"no token attends to itself in {blind.where or 'root'}: the diagonal of the scores is "
                                    f"masked (a causal mask from triu(0) instead of triu(1)?); " + "; ".join(parts))
    low = min((c for c in flow.attention if c.scale_ratio is not None), key=lambda c: c.scale_ratio, default=None)
    if low is not None and low.scale_ratio <= OVERSCALED_RATIO and low.head_dim >= 4 and by_design(ctx, "attention.overscaled"):
        return Status.PASS, round(low.scale_ratio, 3), f"scale x{low.scale_ratio:.2f} {by_design(ctx, 'attention.overscaled')}; " + "; ".join(parts)
    if low is not None and low.scale_ratio <= OVERSCALED_RATIO and low.head_dim >= 4:
        return Status.WARN, round(low.scale_ratio, 3), (
            f"scores scaled more than 1/sqrt(d_head) in {low.where or 'root'}: logit std is {low.scale_ratio:.2f}x what "
            f"q.k/sqrt(d_head) predicts (1/sqrt(d_model) gives 1/sqrt(n_heads); the scale applied twice gives "
            f"1/sqrt(d_head); muP's 1/d_head is deliberate); " + "; ".join(parts))
    if worst is not None and worst.scale_ratio >= UNSCALED_RATIO and worst.head_dim >= 4 and by_design(ctx, "attention.unscaled"):
        return Status.PASS, value, f"scale x{worst.scale_ratio:.2f} {by_design(ctx, 'attention.unscaled')}; " + "; ".join(parts)
    if worst is not None and worst.scale_ratio >= UNSCALED_RATIO and worst.head_dim >= 4:
        return Status.WARN, value, (f"scores look unscaled in {worst.where or 'root'}: logit std is {worst.scale_ratio:.2f}x what "
                                    f"q.k/sqrt(d_head) predicts from {worst.scale_note} (sqrt(d_head) = {worst.head_dim ** 0.5:.2f} "
                                    f"if the 1/sqrt(d_head) is missing); " + "; ".join(parts))
    return Status.PASS, value, "; ".join(parts)


def check_kv_cache(ctx: Context):
    """Decoding with the block's cache equals the full causal forward at every position, for two chunkings."""
    from tblock_cli import kvcache

    if not ctx.cfg.causal:
        return Status.SKIP, None, "not asked for (--causal): cached decoding is for causal blocks"
    module = ctx.subject.module
    if not kvcache.has_decode(module):
        return Status.SKIP, None, "the block has no decode(x_t, cache) -> (y_t, cache) method (see docs/decoding.md)"
    T = max(ctx.cfg.seq, KV_SEQ)
    x = ctx.x(seq=T)
    full = eval_forward(ctx, x)
    splits = {"prefill + one token at a time": [T // 2] + [1] * (T - T // 2),
              "chunks of 3": [3] * (T // 3) + ([T % 3] if T % 3 else [])}
    worst, cache = 0.0, None
    with train_mode(module, False), torch.no_grad():
        for label, sizes in splits.items():
            got, cache = kvcache.decode_chunks(module, x.clone(), sizes)
            if got.shape != full.shape:
                return Status.FAIL, list(got.shape), f"{label}: decoded outputs have shape {tuple(got.shape)}, the forward {tuple(full.shape)}"
            per_pos = [rel_diff(got[:, t], full[:, t]) for t in range(T)]
            bad = next((t for t, d in enumerate(per_pos) if d > ctx.tol), None)
            if bad is not None:
                return Status.FAIL, max(per_pos), (f"{label}: position {bad} differs from the full causal forward by {per_pos[bad]:.2e} "
                                                   f"(worst {max(per_pos):.2e}): the cache or the positions are wrong")
            graphs = [t for t in [got, *kvcache.cache_tensors(cache)] if t.grad_fn is not None]
            if graphs:
                return Status.FAIL, len(graphs), f"{label}: a no_grad decode returned {len(graphs)} tensor(s) with a grad_fn: an autograd graph grows across steps"
            worst = max(worst, max(per_pos))
        # Two sequences decoded step by step, interleaved, each with its own cache, equal each decoded alone.
        xb = ctx.x(seq=T)
        ones = [1] * T
        alone_a, _ = kvcache.decode_chunks(module, x.clone(), ones)
        alone_b, _ = kvcache.decode_chunks(module, xb.clone(), ones)
        ca = cb = None
        mixed_a, mixed_b = [], []
        for t in range(T):
            ya, ca = kvcache.decode_step(module, x[:, t : t + 1].clone(), ca)
            yb, cb = kvcache.decode_step(module, xb[:, t : t + 1].clone(), cb)
            mixed_a.append(ya)
            mixed_b.append(yb)
        shared = max(rel_diff(torch.cat(mixed_a, 1), alone_a), rel_diff(torch.cat(mixed_b, 1), alone_b))
        if shared > ctx.tol:
            return Status.FAIL, shared, f"two sequences decoded in turns differ from each decoded alone by {shared:.2e}: the caches share state"
    size = kvcache.cache_bytes(cache)
    return Status.PASS, worst, (f"prefill + one token at a time and chunks of 3 equal the full causal forward (max {worst:.1e}); "
                                f"no grad_fn under no_grad; two caches independent; cache {fmt_bytes(size)} at {T} positions")


def check_norm_placement(ctx: Context):
    """A block with norms of its residual stream uses them one way: every sublayer reads a normalised stream
    (Pre-LN), or the stream is normalised after each residual add (Post-LN)."""
    flow = ctx.dataflow()
    if not flow.stream_norms:
        return Status.SKIP, None, "no norm of the residual stream found: nothing to place"
    if not flow.attention and not flow.found["ffn"]:
        return Status.SKIP, None, "no attention and no FFN found"
    if flow.unnormed_ffn and by_design(ctx, "norm.unnormed_ffn"):
        return Status.PASS, ", ".join(flow.unnormed_ffn), by_design(ctx, "norm.unnormed_ffn")
    if flow.unnormed_ffn:
        return Status.WARN, ", ".join(flow.unnormed_ffn), (
            f"the FFN ({', '.join(flow.unnormed_ffn)}) reads the residual stream with no norm before it, though the block has "
            f"norms (a Pre-LN block missing its second norm, or a Post-LN block missing its first)")
    if flow.split_kv:
        return Status.WARN, ", ".join(flow.split_kv), (
            f"keys/values ({', '.join(flow.split_kv)}) read the un-normalised stream while their queries read the normalised "
            f"one: the norm applied to the queries only (attn(LN(x), x, x)?)")
    if flow.unnormed_attention and not flow.output_normed and by_design(ctx, "norm.unnormed_attention"):
        return Status.PASS, ", ".join(flow.unnormed_attention), by_design(ctx, "norm.unnormed_attention")
    if flow.unnormed_attention and not flow.output_normed:
        return Status.WARN, ", ".join(flow.unnormed_attention), (
            f"attention ({', '.join(flow.unnormed_attention)}) reads the un-normalised stream and no norm follows the residual "
            f"add, while the FFN reads a normalised one: a Pre-LN block missing its first norm, or Post-LN and Pre-LN mixed")
    kind = "Post-LN: the output comes from a norm" if flow.output_normed and flow.unnormed_attention else \
        "every sublayer reads a normalised stream"
    return Status.PASS, None, kind


def check_input_unchanged(ctx: Context):
    x = ctx.x()
    before = x.clone()
    with train_mode(ctx.subject.module, False), torch.no_grad():
        ctx.subject(x)
    if not torch.equal(x, before):
        return Status.FAIL, rel_diff(x, before), "an eval forward changed the caller's tensor in place"
    with train_mode(ctx.subject.module, True), torch.enable_grad():
        ctx.subject(x)
    if not torch.equal(x, before):
        return Status.FAIL, rel_diff(x, before), "a train forward changed the caller's tensor in place"
    return Status.PASS, 0.0, "caller's tensor unchanged by eval and train forwards"


def check_need_weights(ctx: Context):
    mhas = anatomy.attention_modules(ctx.subject.module)
    if not mhas:
        return Status.SKIP, None, "no nn.MultiheadAttention inside; need_weights is its option"
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
        return Status.SKIP, None, "no nn.MultiheadAttention was called in the forward"
    on = [(n, b) for n, nw, b in calls if nw]
    if on:
        wasted = sum(b for _, b in on)
        names = ", ".join(sorted({n or "(root)" for n, _ in on}))
        return Status.WARN, wasted, (f"{names} called with need_weights=True: {fmt_bytes(wasted)} of attention weights computed "
                                     f"and thrown away per forward; pass need_weights=False")
    return Status.PASS, 0, f"{len(calls)} nn.MultiheadAttention call(s), all need_weights=False"


def check_dtype(ctx: Context):
    module = ctx.subject.module
    ref_device = ctx.device if ctx.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    x = ctx.x()
    out = eval_forward(ctx, x)
    ref_module = copy.deepcopy(module).to(device=ref_device, dtype=torch.float64)
    with train_mode(ref_module, False), torch.no_grad():
        ref = ctx.subject.like(ref_module)(x.to(device=ref_device, dtype=torch.float64))
    del ref_module
    name = str(ctx.dtype).replace("torch.", "")
    if not torch.isfinite(out).all():
        return Status.FAIL, None, f"{name} output is not finite where float64 is" if torch.isfinite(ref).all() else "not finite in float64 either"
    err = ((f64(out) - f64(ref)).norm() / f64(ref).norm().clamp_min(1e-30)).item()
    limit = DTYPE_TOLERANCE[ctx.dtype]
    if err > limit:
        return Status.FAIL, err, f"{name} differs from a float64 copy by relative RMS {err:.2e} > {limit:g}"
    return Status.PASS, err, f"{name} vs a float64 copy: relative RMS error (limit {limit:g})"


def check_ffn_share(ctx: Context):
    from tblock_cli.dataflow import predicted_ffn_share

    flow = ctx.dataflow()
    if not flow.found["ffn"]:
        return Status.SKIP, None, "no FFN found in the dataflow (a projection consuming another's output, outside attention)"
    if not flow.found["attention"]:
        return Status.SKIP, None, "no attention found in the dataflow: the share has nothing to compare with"
    groups, mats = flow.group_params(), flow.group_params(matrices_only=True)
    share = groups["ffn"] / flow.total
    predicted = predicted_ffn_share(mats)
    ratio = mats["ffn"] / mats["attention"] if mats["attention"] else float("inf")
    why = "the 2/3 rule" if abs(predicted - 2 / 3) < 5e-4 else f"FFN/attention matrices = {ratio:.2f}, not 2"
    detail = f"FFN share by dataflow roles; matrices predict {predicted:.1%} ({why}); biases and norms {(share - predicted) * 100:+.1f} pt"
    if flow.linear_chains:
        pairs = "; ".join(f"`{a}` and `{b}` compose to one linear map" for a, b in flow.linear_chains)
        return Status.WARN, round(share, 4), f"{pairs}: no nonlinearity between the FFN's projections; {detail}"
    other = groups["other"] / flow.total
    if other > OTHER_SHARE_MAX and by_design(ctx, "ffn_share.other"):
        return Status.PASS, round(share, 4), f"{detail}; {other:.1%} of parameters {by_design(ctx, 'ffn_share.other')}"
    if other > OTHER_SHARE_MAX:
        return Status.WARN, round(share, 4), f"{detail}; {other:.1%} of parameters sit outside attention, FFN and norms"
    return Status.PASS, round(share, 4), detail


def check_reference(ctx: Context):
    if not ctx.subject.builtin:
        return Status.SKIP, None, "needs the built-in block's structure; a user block has no reference"
    from tblock_cli.reference import reference_output

    x = ctx.x().float()
    module = copy.deepcopy(ctx.subject.module).float()
    with train_mode(module, False), torch.no_grad():
        ours = module(x)
        theirs = reference_output(module, ctx.cfg, x)
    diff = (ours - theirs).abs().max().item()
    if not diff <= 1e-5:
        return Status.FAIL, diff, f"differs from nn.TransformerEncoderLayer with the same weights by {diff:.2e} (> 1e-5, float32)"
    return Status.PASS, diff, "max |diff| to nn.TransformerEncoderLayer with copied weights (float32, eval)"


@dataclass(frozen=True)
class Check:
    """One check, declared once: its name, its function, and what it needs established before it can run."""

    name: str
    run: Callable[[Context], tuple]
    needs: tuple[str, ...] = ()


COMPARES = ("shape", "finite", "deterministic")  # checks that compare two forwards of random inputs
GRADS = ("finite", "input_kept")  # checks that take a gradient through the block
REGISTRY: tuple[Check, ...] = (
    Check("shape", check_shape),
    Check("finite", check_finite),
    Check("determinism", check_determinism, ("finite",)),
    Check("input_unchanged", check_input_unchanged),
    Check("grad_input", check_grad_input, GRADS),
    Check("grad_params", check_grad_params, GRADS),
    Check("residual", check_residual, ("shape",) + GRADS),
    Check("batch", check_batch, COMPARES + GRADS),
    Check("padding", check_padding, COMPARES + GRADS + ("independent",)),
    Check("causal", check_causal, COMPARES + GRADS),
    Check("order", check_order, COMPARES + GRADS),
    Check("train_eval", check_train_eval, COMPARES),
    Check("attention", check_attention, ("finite",)),
    Check("kv_cache", check_kv_cache, COMPARES),
    Check("norm_placement", check_norm_placement, ("finite",)),
    Check("need_weights", check_need_weights),
    Check("dtype", check_dtype, COMPARES),
    Check("ffn_share", check_ffn_share),
    Check("reference", check_reference, ("shape", "deterministic")),
)
CHECK_NAMES = tuple(c.name for c in REGISTRY)


def run_checks(subject: Subject, cfg: BlockConfig, device: torch.device, dtype: torch.dtype, *,
               strict: bool = False, progress: Callable[[str], None] | None = None, run: RunInfo | None = None,
               only: tuple[str, ...] | None = None) -> CheckReport:
    """Run the battery; a check that raises becomes `error` and the rest still run; unmet needs skip."""
    ctx = Context(subject, cfg, device, dtype)
    results = []
    for check in REGISTRY:
        if only is not None and check.name not in only:
            continue
        if progress:
            progress(check.name)
        unmet = next((ctx.unmet[n] for n in check.needs if n in ctx.unmet), None) or by_design(ctx, check.name + ".skip")
        if unmet:
            results.append(CheckResult(check.name, Status.SKIP, None, unmet))
            continue
        try:
            status, value, detail = check.run(ctx)
        except Exception as e:  # noqa: BLE001 - the block under test raised; report it, go on
            if is_out_of_memory(e):
                raise
            status, value, detail = Status.ERROR, None, one_line(e)
        need = ESTABLISHES.get(check.name)
        if need and status in (Status.FAIL, Status.ERROR):
            ctx.unmet[need] = NEED_REASON[need]
        results.append(CheckResult(check.name, status, value, detail))
    return CheckReport(tuple(results), strict, run)
