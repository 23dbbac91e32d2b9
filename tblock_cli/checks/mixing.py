"""Checks of what may reach what: padded positions, later positions (token order: order.py; samples in a batch: batch.py)."""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

from tblock_cli.anatomy.mha import attention_modules
from tblock_cli.checks.context import (
    CAUSAL_BY_ITSELF,
    Context,
    all_finite,
    eval_forward,
    eval_forwards,
    eval_together,
    input_grad,
    nonfinite_kind,
    projected,
)
from tblock_cli.checks.half_rounding import prefix_exact_in_float64
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import beyond, f64, grad_of, grads_kept, math_attention, rel_diff, train_mode, update_share

# Names that mark position machinery inside a block; token order then matters by design.
POSITIONAL_NAMES = re.compile(r"rotary|rope|alibi|rel_?pos|relative|pos_?emb|position|inv_freq|sinusoid|wpe|(^|[._])pos([._]|$)", re.I)


def pad_lengths(B: int, T: int) -> torch.Tensor:
    """Real tokens per sample: sample i keeps T - max(1, T // 3) - i of T (at least 1)."""
    return torch.tensor([max(1, T - max(1, T // 3) - i) for i in range(B)])


def padding_mask(ctx: Context, B: int, T: int, left: bool = False) -> torch.Tensor:
    """(B, T) bool, True = padding: on the right (real tokens first), or on the left."""
    n = pad_lengths(B, T)
    pos = torch.arange(T)[None, :]
    mask = pos < (T - n)[:, None] if left else pos >= n[:, None]
    return mask.to(ctx.device)


def positional_reason(ctx: Context) -> dict | None:
    """Why token order may matter here by design: --positional, or position machinery found by name."""
    if ctx.cfg.positional:
        return {"declared": True}
    module = ctx.subject.module
    for name, _ in list(module.named_modules()) + list(module.named_parameters()) + list(module.named_buffers()):
        if name and POSITIONAL_NAMES.search(name):
            return {"found": name}
    return None


def left_padded(x: torch.Tensor) -> torch.Tensor:
    """x laid out for left padding (padding_mask(left=True)): each sample's real tokens of the right-padded layout
    moved to the end, its pads to the front, so both layouts' real tokens are the same and one run of them alone
    serves both comparisons."""
    B, T, _ = x.shape
    return torch.stack([x[i].roll(T - n, dims=0) for i, n in enumerate(pad_lengths(B, T).tolist())])


def alone_outputs(ctx: Context, x: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's real tokens of the right-padded layout (x[i, :n]) run alone: (n, d) each."""
    B, T, _ = x.shape
    return [eval_forward(ctx, x[i : i + 1, :n])[0] for i, n in enumerate(pad_lengths(B, T).tolist())]


def padded_equals_alone(alone: list[torch.Tensor], left: bool, out: torch.Tensor,
                        x: torch.Tensor) -> tuple[float, float, str | None]:
    """max rel. diff between each sample's real positions in a padded batch (out: its eval output) and the same tokens
    run alone (alone_outputs, of x's right-padded layout), and that difference as a share of the block's update
    (`update_share`); or what non-finite value the real positions got (then nothing is compared)."""
    T = out.shape[1]
    worst, share = 0.0, 0.0
    for i, ref in enumerate(alone):
        n = ref.shape[0]
        got = out[i, T - n :] if left else out[i, :n]
        if not torch.isfinite(got).all() and torch.isfinite(ref).all():
            return 0.0, 0.0, nonfinite_kind(got)
        worst, share = max(worst, rel_diff(got, ref)), max(share, update_share(got, ref, x[i, :n]))
    return worst, share, None


def fully_padded_mask(ctx: Context, B: int, T: int) -> torch.Tensor:
    """(B, T): sample 0 all padding, the others none."""
    mask = torch.zeros(B, T, dtype=torch.bool, device=ctx.device)
    mask[0] = True
    return mask


def fully_padded_facts(out: torch.Tensor) -> dict:
    """What a sequence whose every key is padding produced (out: its (T, d) output): information, PyTorch's paths
    differ."""
    if torch.isnan(out).any():
        what = "NaN" if torch.isnan(out).all() else "some NaN"
    elif not out.any():
        what = "zeros"
    else:
        what = "finite values"
    return {"fully_padded": what}


def fully_padded(ctx: Context, x: torch.Tensor, T: int) -> dict:
    """fully_padded_facts of x's sample 0 run with every key padding, or that the forward raises."""
    try:
        out = eval_forward(ctx, x, fully_padded_mask(ctx, x.shape[0], T))[0]
    except Exception as e:  # noqa: BLE001
        return {"fully_padded": "raises", "fully_padded_error": one_line(e)}
    return fully_padded_facts(out)


def check_padding(ctx: Context) -> Outcome:
    """Catches: padded inputs that reach real outputs (values in eval, gradients in train); and the real positions of a
    padded batch that differ from the same tokens run alone (beyond the tolerance, or beyond 1 % of what the block
    adds to its input, where the output is mostly the input: LayerScale started at 1e-5), with right padding, and
    with left padding for causal blocks (declared or causal by themselves) without positions inside; there, a
    training backward of the left-padded batch's real outputs with non-finite gradients while its forward is finite
    (a -inf mask's NaN rows hidden by `nan_to_num`)"""
    if ctx.subject.pad_keyword is None:  # an hf: layer whose model takes no mask (vision, audio): --pad-keyword is no help
        return skipped("padding.hf_no_mask" if ctx.subject.name.startswith("hf:") else "padding.no_keyword")
    B, T = max(2, ctx.cfg.batch), max(ctx.cfg.seq, 3)
    x = ctx.x(B, T)
    mask = padding_mask(ctx, B, T)
    x2 = x.clone()
    x2[mask] = ctx.randn(int(mask.sum()), ctx.cfg.d_model, scale=3.0)
    keep = ~mask
    # Left padding too where the block is causal (right pads come after every real token, so a decoder that ignores
    # its mask cannot show it there) or has positions inside: relative schemes (RoPE, ALiBi, relative biases) are
    # shift-invariant and absolute positions taken from the mask restart at the first real token, so a left-padded
    # batch equals the tokens run alone for all of them.
    causal = ctx.cfg.causal or causal_by_itself(ctx, x)
    positional = positional_reason(ctx)
    sides = ["right"] + (["left"] if causal or positional is not None else [])
    # The padded batches side by side in one forward where samples are known apart (padded: the right side's batch)
    left_mask, x_left = padding_mask(ctx, B, T, left=True), left_padded(x)
    probes = [(x2, mask), (x, mask)] + ([(x_left, left_mask)] if "left" in sides else []) + [(x, fully_padded_mask(ctx, B, T))]
    outs = eval_together(ctx, [p for p, _ in probes], [m for _, m in probes])
    if outs is None:
        full = fully_padded(ctx, x, T)
        changed_pads, padded = eval_forward(ctx, x2, mask), eval_forward(ctx, x, mask)
        left_once = None
    else:
        changed_pads, padded, left_once, full = outs[0], outs[1], outs[2] if "left" in sides else None, fully_padded_facts(outs[-1][0])
    diff = rel_diff(changed_pads[keep], padded[keep])
    if diff > ctx.tol:
        return failed("padding.ignored", diff, diff=diff, **full)
    g = input_grad(ctx, x, lambda out: projected(ctx, out[keep]), pad_mask=mask)
    if g is not None and g[mask].any():
        return failed("padding.gradient", f64(g[mask]).abs().max().item(), **full)
    # Second half: the real positions of a padded batch equal the same real tokens run alone.
    # nn.MultiheadAttention gives NaN at a fully masked query row (PyTorch's own behaviour, PYTORCH-NOTES), and so does
    # sdpa before torch 2.5: reported, not failed; a block's own -inf fill doing the same fails
    mha = bool(attention_modules(ctx.subject.module)) or (uses_sdpa(ctx) and sdpa_fills_nan(ctx.device, ctx.dtype))
    nonfinite = []
    worst, alone = 0.0, None
    for side in sides:
        ctx.step(f"{side} padding against each sample alone")
        side_mask = mask if side == "right" else left_mask
        once = padded if side == "right" else left_once if left_once is not None else eval_forward(ctx, x_left, side_mask)
        alone = alone_outputs(ctx, x) if alone is None else alone  # the same real tokens on both sides: run once
        eq, share, got = padded_equals_alone(alone, side == "left", once, x)
        if got:
            nonfinite.append({"side": side, "got": got})
            continue
        if beyond(eq, share, ctx.tol):
            return failed("padding.differs_alone", eq, side=side, diff=eq, positional=positional is not None,
                          update_share=share)
        worst = max(worst, eq)
        spread = spread_through_twice(ctx, once, side_mask)
        if spread and not mha:
            return failed("padding.nan_spreads", None, side=side, got=spread, **full)
        if spread:
            nonfinite.append({"side": side, "got": spread, "twice": True})
    if nonfinite and not mha:
        return failed("padding.nan_spreads", None, side=nonfinite[0]["side"], got=nonfinite[0]["got"], **full)
    if "left" in sides and not nonfinite:
        ctx.step("a training backward through left padding")
        bad = nonfinite_grads(ctx, x_left, left_mask)
        if bad:
            return failed("padding.grad_nonfinite", None, side="left", params=bad, **full)
    return passed("padding.respected", worst, sides=sides, diff=worst, nonfinite=nonfinite, **full)


def uses_sdpa(ctx: Context) -> bool:
    return any(c.kind == "scaled_dot_product_attention" for c in ctx.dataflow().attention)


@functools.lru_cache(maxsize=None)
def sdpa_fills_nan(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's sdpa gives NaN for a query whose every key is masked (before torch 2.5 it does, as
    nn.MultiheadAttention does; from 2.5 on a zero row): PyTorch's behaviour, which padding reports and does not fail."""
    q = torch.ones(1, 1, 1, 8, device=device, dtype=dtype)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device))
    return bool(torch.isnan(out).any())


def nonfinite_grads(ctx: Context, x: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The parameters (and `input`) whose gradient is non-finite after a train forward of the padded batch x and a
    backward of a loss on its real positions only; [] where the forward itself is not finite everywhere (its NaN
    rows are then what is reported). A causal block's first left-padded rows see no real key: a -inf fill turns them
    to NaN, and a `nan_to_num` after the softmax hides it from the forward but not from the backward (0 * NaN).
    sdpa runs its math backend here: a fused kernel's backward gives NaN for such rows on a CUDA device in half
    precision whatever the block does (measured on an H100: nine correct blocks, Hugging Face's among them)."""
    module = ctx.subject.module
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    x = x.detach().clone().requires_grad_(True)
    bad: list[str] = []

    def judged(name: str):
        def hook(g: torch.Tensor):  # each gradient judged as it is computed and not kept: the peak is one tensor's
            if not all_finite(g):
                bad.append(name)
            return torch.zeros((), dtype=g.dtype, device=g.device).expand_as(g)
        return hook

    with train_mode(module, True), torch.enable_grad(), math_attention(), grads_kept(module):
        out = ctx.subject(x.clone(), mask)
        if not torch.isfinite(out).all():
            return []
        loss = projected(ctx, out[~mask])
        if not loss.requires_grad:
            return []
        handles = [p.register_hook(judged(n)) for n, p in params]
        try:
            gx = grad_of(loss, x, also=[p for _, p in params])
        finally:
            for h in handles:
                h.remove()
    seen = set(bad)
    return (["input"] if gx is not None and not all_finite(gx) else []) + [n for n, _ in params if n in seen]


def spread_through_twice(ctx: Context, once: torch.Tensor, mask: torch.Tensor) -> str | None:
    """What the real positions get when the padded batch's output (once) runs through the block again (two such
    layers stacked): a non-finite value at a padded row reaches every real one through 0 * NaN in the weighted sum."""
    if torch.isfinite(once).all():
        return None
    twice = eval_forward(ctx, once, mask)
    return None if torch.isfinite(twice[~mask]).all() else nonfinite_kind(twice[~mask])


def future_grad(ctx: Context, x: torch.Tensor, t: int, train: bool) -> torch.Tensor | None:
    """Gradient of the outputs up to t w.r.t. the inputs after t: exactly zero in a causal block."""
    g = input_grad(ctx, x, lambda o: projected(ctx, o[:, : t + 1]), train=train)
    return None if g is None else g[:, t + 1 :]


def causal_by_itself(ctx: Context, x: torch.Tensor) -> bool:
    """Whether the block's outputs ignore later positions already: a property of the block, so the CAUSAL_BY_ITSELF
    probe reads it once, on the input the first check that asks hands it."""
    def compute() -> bool:
        g = future_grad(ctx, x, x.shape[1] // 2, train=False)
        return g is None or not g.any()
    return ctx.probe(CAUSAL_BY_ITSELF, compute)


def check_causal(ctx: Context) -> Outcome:
    """Catches: with `--causal`, or where the block says it is causal (a `causal=True` it was built with or keeps, a
    `CausalSelfAttention`): outputs up to t that move when inputs after t change, or have a gradient w.r.t. them;
    outputs up to t that differ when the first t + 1 tokens run alone (one token, half the sequence: something reads
    the sequence's length); a **warning** where a block built with `causal=False` is exactly causal while it mixes
    tokens (the argument never reaches the mask, a window seeing one side)"""
    T = max(ctx.cfg.seq, 3)
    x = ctx.standard()[0] if T == ctx.cfg.seq else ctx.x(seq=T)
    claimed = None if ctx.cfg.causal else claimed_causal(ctx)
    if not ctx.cfg.causal and claimed is None:  # not asked for; say what the block does, as information
        by_itself = causal_by_itself(ctx, x)
        said = said_bidirectional(ctx) if by_itself else None
        if said is not None and mixes_past(ctx, x):
            return warned("causal.said_bidirectional", 0.0, said=said)
        return skipped("causal.not_asked", causal_by_itself=by_itself)
    said = {} if claimed is None else {"claimed": claimed}
    out = ctx.standard()[1] if T == ctx.cfg.seq else eval_forward(ctx, x)
    worst, worst_t = 0.0, None
    ts = sorted({0, T // 2, T - 2})
    changed_after = []
    for t in ts:
        x2 = x.clone()
        x2[:, t + 1 :] = ctx.randn(x.shape[0], T - t - 1, ctx.cfg.d_model, scale=3.0)
        changed_after.append(x2)
    for t, got in zip(ts, eval_forwards(ctx, changed_after)):
        diff = rel_diff(got[:, : t + 1], out[:, : t + 1])
        if diff > worst:
            worst, worst_t = diff, t
    if worst > ctx.tol:
        return failed("causal.leak", worst, t=worst_t, diff=worst, **said)
    prefix = _prefix_differs(ctx, x, out)
    if prefix is not None:
        prefix.facts.update(said)
        return prefix
    t = T // 2
    g = future_grad(ctx, x, t, train=True)
    if g is not None and g.any():
        return failed("causal.leak_train", f64(g).abs().max().item(), t=t, **said)
    return passed("causal.respected", worst, **said)


def said_bidirectional(ctx: Context) -> str | None:
    """Where a block of the user's was built with `causal=False` (or `is_causal=False`) as a constructor argument: what
    it was asked to be. Attributes and class names are not read: a kept False may mean a mask passed in."""
    if ctx.subject.builtin or ctx.subject.name.startswith("hf:"):
        return None
    from tblock_cli.card.own_causal import CAUSAL_NAMES
    from tblock_cli.subject.loading import constructed_arguments

    built = constructed_arguments(ctx.subject.module) or {}
    return next((f"constructor argument `{n}=False`" for n in CAUSAL_NAMES if built.get(n) is False), None)


def mixes_past(ctx: Context, x: torch.Tensor) -> bool:
    """Whether the last position's output reads earlier positions at all (a block that mixes no tokens is causal
    trivially, and says nothing by it)."""
    g = input_grad(ctx, x, lambda o: o[:, -1].float().sum(), train=False)
    return g is not None and bool(g[:, :-1].any())


def claimed_causal(ctx: Context) -> str | None:
    """Where a block of the user's says it is causal (card.own_causal.own_causal); None for the built-in block and hf:
    layers, whose causality tblock sets from --causal and from what the model does."""
    if ctx.subject.builtin or ctx.subject.name.startswith("hf:"):
        return None
    from tblock_cli.card.own_causal import own_causal
    from tblock_cli.checks.training import all_modules
    from tblock_cli.subject.loading import constructed_arguments

    module = ctx.subject.module
    try:
        return own_causal(all_modules(module), constructed_arguments(module))
    except Exception:  # noqa: BLE001 - a config that cannot be read (asdict of an odd field) says nothing
        return None


def _prefix_differs(ctx: Context, x: torch.Tensor, out: torch.Tensor) -> Outcome | None:
    """A causal block's outputs up to t are a function of the inputs up to t: the first t + 1 tokens run alone must give
    them (one token, half the sequence). A failure where they do not: something reads the sequence's length (a scale by
    T, positions counted from the end, a table or mask cut to the wrong size); None where they do, where the short run's
    shape is not the input's, or one token is refused (`shape` warns of it), or only half precision's rounding differs."""
    diffs = {}  # t -> (rel_diff, update_share)
    for t in sorted({0, x.shape[1] // 2}):
        ctx.step(f"the first {t + 1} token(s) alone")
        try:
            alone = eval_forward(ctx, x[:, : t + 1])
        except Exception as e:  # noqa: BLE001 - one token refused: by the model before its layer (nanochat's T > 1),
            if t or is_out_of_memory(e):  # or by the block itself (a top-k of 4 keys), which `shape` warns of
                raise
            continue
        if alone.shape != x[:, : t + 1].shape:
            continue
        diffs[t] = (rel_diff(alone, out[:, : t + 1]), update_share(alone, out[:, : t + 1], x[:, : t + 1]))
    bad = [t for t, (d, u) in diffs.items() if beyond(d, u, ctx.tol)]
    if bad and not prefix_exact_in_float64(ctx, x, bad):  # half precision's rounding may flip a top-k: not a length read
        t = max(bad, key=lambda t: diffs[t])
        return failed("causal.prefix", diffs[t][0], t=t, diff=diffs[t][0], update_share=diffs[t][1])
    return None
