"""One optimizer step does what it should: the loss falls, every parameter with a gradient moves, none is held at
its initialisation for ever, no tie was broken by a copy."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.checks.context import Context
from tblock_cli.checks.result import Outcome, failed, passed, skipped, warned
from tblock_cli.checks.training import PROBE_SEED, copied, seeded, too_large, trainable
from tblock_cli.checks.zeros import default_scale
from tblock_cli.errors import is_out_of_memory
from tblock_cli.probes import parameters_replaced, rel_diff, train_mode

# One AdamW step: lr 1e-4 moves every float32 parameter with a non-zero gradient (lr / |p| >> 2^-23 for |p| < 100) and
# stays where the first-order decrease (lr * |g|_1) dominates; no weight decay, so only a gradient moves a parameter.
STEP_LR = 1e-4
# Two parameters are a broken tie only when their values look random: at least this many elements, mostly distinct
# (a ones or zeros initialisation, or any constant, is shared by design and is not evidence).
def frozen_slips(module: nn.Module) -> list[str]:
    """Parameters with requires_grad=False that look frozen by mistake: a `weight` or `bias` (of any module but an
    embedding table, which a fixed sinusoidal table freezes), or one whose name another module of the same class
    trains. A frozen parameter of another name that no sibling trains is a fixed table (rotary `inv_freq`, MAE's
    sin-cos `pos_embed`) kept as a parameter by design."""
    trained = {(type(m), n) for m in module.modules() for n, p in m.named_parameters(recurse=False) if p.requires_grad}
    modules = dict(module.named_modules())
    out = []
    for mname, m in module.named_modules():
        if adapted(m, modules[mname.rpartition(".")[0]] if mname else module):
            continue  # a frozen base beside its trainable low-rank adapter (LoRA, DoRA): the design
        for n, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                continue
            layer = n in ("weight", "bias") and not isinstance(m, nn.Embedding)
            if layer or (type(m), n) in trained:
                out.append(f"{mname}.{n}" if mname else n)
    return out


def adapted(m: nn.Module, parent: nn.Module) -> bool:
    """Whether m's frozen (out, in) weight has a trainable low-rank pair beside it, in m or its parent's subtree: a
    matrix (r, in) and one (out, r) with r below both, as LoRA's A and B (loralib's on the layer itself, PEFT's beside
    its `base_layer`)."""
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.requires_grad or w.ndim != 2:
        return False
    out, inp = w.shape
    shapes = {tuple(p.shape) for p in parent.parameters() if p.requires_grad and p.ndim == 2}
    return any(a[1] == inp and a[0] < min(out, inp) and (out, a[0]) in shapes for a in shapes)


TIE_MIN_NUMEL = 16
TIE_DISTINCT = 0.5
# A parameter no step will ever move: its gradient exactly zero at init and still after the step, and alive once the
# parameters stuck with it hold random values (the default init's scale: uniform +-1/sqrt(fan_in)), its largest entry
# then above this share of the largest gradient entry of the block. Two zero factors of one product hold each other
# at 0 (an FFN's up and down, v and o, q and k all zero): each one's gradient is the other. A key bias's gradient is
# zero by the softmax's shift invariance, whatever the weights: its rounding (~1e-7 of the others) stays far below.
STUCK_ALIVE = 1e-4
# Frozen parameters are a slip (a norm weight left at requires_grad=False) where they are a small part of the block;
# where they hold most of it, freezing is the design: adapters (LoRA, prefix tuning) train beside a frozen base.
FROZEN_SHARE = 0.5
# After the step an eval forward must compute the same with gradients off as on: paths differ only in rounding (nn.MHA's
# fused eval path runs without them), far below what a weight kept from before the step moves (the step's own size).
STALE_LIMIT = 1e-4


def _random_looking(t: torch.Tensor) -> bool:
    return t.numel() >= TIE_MIN_NUMEL and t.detach().flatten().unique().numel() >= TIE_DISTINCT * t.numel()


def symmetric_units(ctx: Context) -> dict | None:
    """Hidden units in identical copies: an FFN's unit i and unit j with equal input rows (gate and up, and their
    biases) and equal output columns, or two channels of one attention head with equal value rows and output columns,
    compute the same thing and get the same gradient at every step, so they stay copies forever (an init typo,
    `nn.init.constant_(w, 0.02)` for `normal_(std=0.02)`; rows tiled from a few). Judged on one dense FFN, and on one
    attention's value and output projections, of nn.Linear projections whose widths meet; found where fewer than
    half of the units are distinct. Exact equality: random draws never repeat, and a zero output projection alone
    (ReZero) leaves the input rows apart. The facts, or None."""
    try:
        flow = ctx.dataflow()
    except Exception as e:  # noqa: BLE001 - a block the tracer cannot follow: no evidence
        if is_out_of_memory(e):
            raise
        return None
    mods = dict(ctx.subject.module.named_modules())

    def linears(*roles: str) -> list[tuple[str, nn.Module]]:
        return [(m.name, mods.get(m.name)) for m in flow.modules if m.role in roles]

    found = []
    ins, outs = linears("ffn.in", "ffn.gate"), linears("ffn.out")
    if len(outs) == 1 and ins and all(isinstance(m, nn.Linear) for _, m in ins + outs) and \
            all(m.out_features == outs[0][1].in_features for _, m in ins):
        found.append(("the FFN", ins + outs, _distinct([m for _, m in ins], outs[0][1], 1)))
    values, out = linears("attn.v"), linears("attn.out")
    call = next((c for c in flow.attention if values[0][0] in c.v), None) if len(values) == 1 else None
    if call is not None and len(out) == 1 and all(isinstance(m, nn.Linear) for _, m in values + out) and \
            values[0][1].out_features == out[0][1].in_features and values[0][1].out_features % max(1, call.heads) == 0:
        found.append(("attention's values", values + out, _distinct([values[0][1]], out[0][1], call.heads)))
    for where, named, (units, distinct) in found:
        if units >= 4 and distinct * 2 < units:
            return {"units": units, "distinct": distinct, "where": where, "modules": [n for n, _ in named]}
    return None


def _distinct(ins: list[nn.Linear], out: nn.Linear, groups: int) -> tuple[int, int]:
    """(units, distinct units) of the hidden layer between ins and out, units compared within each of `groups`
    consecutive runs (an attention head's channels)."""
    hidden = out.in_features
    with torch.no_grad():
        parts = [m.weight for m in ins] + [m.bias[:, None] for m in ins if m.bias is not None] + [out.weight.t()]
        units = torch.cat([t.detach().float().reshape(hidden, -1) for t in parts], dim=1)
        size = hidden // groups
        distinct = sum(torch.unique(units[g * size:(g + 1) * size], dim=0).shape[0] for g in range(groups))
    return hidden, distinct


def broken_ties(module: nn.Module) -> list[list[str]]:
    """Pairs of distinct parameters (no shared storage) holding the same random-looking values, but for the same
    parameter of two entries of a ModuleList or Sequential that are copies of one layer whole (torch's
    nn.TransformerEncoder deep-copies its layer: independent layers that start equal and train apart by design)."""
    params = [(n, p) for n, p in module.named_parameters()]
    pairs, clones = [], {}
    for i, (n, p) in enumerate(params):
        for m, q in params[i + 1:]:
            if (p.shape == q.shape and p.dtype == q.dtype and p.data_ptr() != q.data_ptr()
                    and torch.equal(p.detach(), q.detach()) and _random_looking(p)
                    and not _cloned_layers(module, n, m, clones)):
                pairs.append([n, m])
    return pairs


def _cloned_layers(module: nn.Module, n: str, m: str, seen: dict) -> bool:
    """Whether n and m are one parameter of entries i and j of one container, and those entries are equal whole
    (each pair of entries compared once: `seen`)."""
    a, b = n.split("."), m.split(".")
    at = next((k for k, (u, v) in enumerate(zip(a, b)) if u != v), None)
    if at is None or a[at + 1:] != b[at + 1:]:
        return False
    key = (".".join(a[:at]), a[at], b[at])
    if key not in seen:
        container, seen[key] = module.get_submodule(key[0]), False
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            first, second = (dict(container.get_submodule(k).named_parameters()) for k in key[1:])
            seen[key] = first.keys() == second.keys() and all(
                first[k].shape == second[k].shape and torch.equal(first[k].detach(), second[k].detach()) for k in first)
    return seen[key]


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)  # whose entries are meant to be modules of their own


def repeated(module: nn.Module) -> list[list[str]]:
    """Groups of entries of one container (ModuleList, Sequential, ModuleDict) that are one module object: what
    `nn.ModuleList([Head()] * n)` builds where `[Head() for _ in range(n)]` was meant. The n entries share every
    parameter and compute the same, and named_parameters lists them once, so nothing else counts them twice."""
    return [names for name, m in module.named_modules() if isinstance(m, CONTAINERS) for _, names in _one_child(name, m)]


def _one_child(name: str, m: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """(child, its names) for each child with parameters that m holds under more than one name."""
    by_id: dict[int, tuple[nn.Module, list[str]]] = {}
    for key, child in m._modules.items():  # named_children would list a repeated child once
        if child is not None and any(True for _ in child.parameters()):  # a shared ReLU or Dropout is no harm
            by_id.setdefault(id(child), (child, []))[1].append(f"{name}.{key}" if name else key)
    return [(child, names) for child, names in by_id.values() if len(names) > 1]


def _calls(ctx: Context) -> dict:
    """The dataflow's count of each module's calls; none where the tracer cannot follow the block."""
    try:
        return ctx.dataflow().calls
    except Exception as e:  # noqa: BLE001 - the dataflow's own failure is the checks' that read it
        if is_out_of_memory(e):
            raise
        return {}


def named_twice(module: nn.Module, calls: dict) -> list[list[str]]:
    """Groups of attribute names one module object (with parameters of its own) is registered under in one parent,
    where the forward called it more than once (`calls`: the dataflow's count): `self.q_proj = self.k_proj =
    nn.Linear(...)` builds one projection for two places, so queries equal keys. An alias a forward calls once (a
    second name kept for old checkpoints) is no such slip."""
    first = {id(m): n for n, m in module.named_modules()}  # the name the dataflow counted its calls under
    return [names for name, m in module.named_modules() if not isinstance(m, CONTAINERS)  # containers: `repeated`
            for child, names in _one_child(name, m) if calls.get(first[id(child)], 0) > 1]


def aliased(module: nn.Module) -> list[list[str]]:
    """Groups of distinct parameters whose memory overlaps (`b.weight.data = a.weight.data`, `nn.Parameter(a.weight)`):
    two Parameters, each with its own gradient and optimizer state, on one storage, so every step updates it once per
    name and weight decay shrinks it as often. A tie made as a tie (`b.weight = a.weight`) is one Parameter, listed
    once by named_parameters, and is not seen here."""
    spans = []
    for n, p in module.named_parameters():
        try:
            if type(p.data) is not torch.Tensor or p.device.type == "meta" or p.numel() == 0:
                continue
            size = p.element_size()
            start = p.data_ptr()
            end = start + size * (1 + sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride())))
            spans.append((p.untyped_storage().data_ptr(), start, end, n))
        except (RuntimeError, NotImplementedError):  # a tensor subclass without plain storage (DTensor, quantised)
            continue
    groups: list[list[str]] = []
    spans.sort()
    for i, (base, _start, end, n) in enumerate(spans):
        overlapping = [m for base2, start2, _end, m in spans[i + 1:] if base2 == base and start2 < end]
        if overlapping:
            group = next((g for g in groups if n in g), None)
            if group is None:
                groups.append(group := [n])
            group.extend(m for m in overlapping if m not in group)
    return groups


def adamw_first_step(params: list[nn.Parameter], lr: float, eps: float = 1e-8) -> None:
    """torch.optim.AdamW's first step (no weight decay), written out: from a fresh state its moments are (1 - b1) g
    and (1 - b2) g^2, bias-corrected to g and g^2, so each parameter moves by lr * g / (|g| + eps). torch.optim's
    first step imports torch._dynamo (1 s idle, several under load); a test holds the two equal."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(first_update(p.grad, lr, eps))


def first_update(g: torch.Tensor, lr: float, eps: float = 1e-8) -> torch.Tensor:
    """AdamW's first step from a fresh state, bias-corrected: lr * g / (|g| + eps)."""
    return lr * g / (g.abs() + eps)


def _resolvable(p: nn.Parameter, lr: float, eps: float = 1e-8) -> bool:
    """Whether AdamW's first step, lr * g / (|g| + eps), is above one unit in the last place of some element of p: a
    gradient of pure rounding (a pre-softmax bias's, ~1e-16 by the softmax's shift invariance: CaiT's talking heads)
    moves nothing, and must not read as a step that failed to move it."""
    step = first_update(p.grad.detach().double(), lr, eps).abs()
    return bool((step > torch.finfo(p.dtype).eps * p.detach().abs().double()).any())


def check_optimizer_step(ctx: Context) -> Outcome:
    """Catches: one AdamW step (lr 1e-4) on a fixed regression target that does not lower the loss or leaves a
    parameter with a gradient unchanged; parameters no step will ever move (zeros that hold each other's gradient at
    exactly 0, at init and after the step, alive once given random values: an FFN or v and o zero-initialised
    together); two distinct parameters holding the same random values (a tie broken by a copy), or sharing one
    storage (`b.weight.data = a.weight.data`: each step updates it twice); parameters with
    `requires_grad=False` are a **warning** where they hold less than half the block's parameters and are a layer's
    weight or bias, or a parameter another module of the same class trains (a norm weight frozen by mistake; a frozen
    base under adapters, a fixed table kept as a frozen parameter, `inv_freq` or MAE's `pos_embed`, are designs);
    after the step, an eval forward without gradients
    that differs from one with them (a fused or cached weight an inference call kept from before the step); one module
    object at several entries of a ModuleList or Sequential is a **warning** (`[Head()] * n`: n heads that are one),
    and so is one under two attribute names that the forward calls more than once (`self.q = self.k = Linear(...)`);
    an FFN's hidden units or an attention head's value channels fewer than half distinct (equal input rows and output
    columns: copies that get equal gradients forever, a constant init where a random one was meant)"""
    if (large := too_large(ctx)) is not None:
        return large
    ties = broken_ties(ctx.subject.module)  # at build: the module has not been trained by any check
    twins = symmetric_units(ctx)
    aliases = aliased(ctx.subject.module)
    repeats = repeated(ctx.subject.module) + named_twice(ctx.subject.module, _calls(ctx))
    x = ctx.x()
    target = torch.randn(x.shape, generator=ctx.gen)
    step = _adamw_step(ctx, x, target, train=True)
    if step is None:
        return skipped("optimizer_step.no_params", frozen=[n for n, p in ctx.subject.module.named_parameters()
                                                           if not p.requires_grad])
    if not step["loss_after"] < step["loss_before"] and not step["repeatable"]:
        # masks the seed does not fix (the block's own generator): the two losses saw other masks, so the step is
        # judged in eval mode, where one forward is the same function before and after the step
        step = _adamw_step(ctx, x, target, train=False)
    first, second = step.pop("loss_before"), step.pop("loss_after")
    unchanged = step["unchanged"]
    facts = {"loss_before": first, "loss_after": second, "lr": STEP_LR, "ties": ties, "aliases": aliases, **step}
    value = f"{first:.4g} -> {second:.4g}"
    if not second < first:
        return failed("optimizer_step.loss_not_lowered", value, **facts)
    if ties:
        return failed("optimizer_step.tie_broken", value, **facts)
    if aliases:
        return failed("optimizer_step.aliased", value, **facts)
    if step["stale"] > STALE_LIMIT:
        return failed("optimizer_step.stale", value, limit=STALE_LIMIT, **facts)
    if unchanged:
        return failed("optimizer_step.unchanged", value, **facts)
    if step["stuck"]:
        return failed("optimizer_step.stuck", value, **facts)
    if twins is not None:
        return failed("optimizer_step.symmetric_units", f"{twins['distinct']}/{twins['units']}", **{**facts, **twins})
    if repeats:
        return warned("optimizer_step.repeated", value, repeats=repeats, **facts)
    if (slips := frozen_slips(ctx.subject.module)) and step["frozen_share"] < FROZEN_SHARE:
        return warned("optimizer_step.frozen", value, **{**facts, "frozen": slips})
    return passed("optimizer_step.ok", value, **facts)


def _adamw_step(ctx: Context, x: torch.Tensor, target: torch.Tensor, train: bool) -> dict | None:
    """One AdamW step on a copy (float32 for a half-precision run): the loss before and after at the same seed, the
    parameters it left unchanged, and whether the loss before repeats at that seed. None without trainable ones."""
    module = copied(ctx.subject.module)
    if ctx.dtype in (torch.float16, torch.bfloat16):
        module = module.float()  # the step's size must show in every parameter: 1e-4 is below a half's resolution
    subject = ctx.subject.like(module)
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    share = sum(p.numel() for p in module.parameters() if not p.requires_grad) / max(1, sum(
        p.numel() for p in module.parameters()))
    params = trainable(module)
    if not params:
        return None
    x = x.to(next(iter(module.parameters())).dtype)
    target = target.to(x)
    before = {n: p.detach().clone() for n, p in params}

    def loss() -> torch.Tensor:  # the input requires grad, as a layer's inside a model does
        with seeded(ctx.device), train_mode(module, train):
            return (subject(x.clone().requires_grad_(True)).double() - target.double()).pow(2).mean()

    with seeded(ctx.device), train_mode(module, False), torch.no_grad():
        subject(x.clone())  # an inference call before the step, as validation or generation makes one
    for p in module.parameters():
        p.grad = None
    with torch.enable_grad():
        first = loss()
        first.backward()
    zero = [n for n, p in params if p.grad is not None and not p.grad.any()]
    no_grad = [n for n, p in params if p.grad is None]
    below = [n for n, p in params if n not in zero and p.grad is not None and not _resolvable(p, STEP_LR)]
    adamw_first_step([p for _, p in params], STEP_LR)
    stuck, held = [], []
    if zero:  # the step's loss and, once, gradients again: does any zero gradient come alive after it?
        for p in module.parameters():
            p.grad = None
        with torch.enable_grad():
            second = loss()
            second.backward()
        still = [n for n, p in params if n in zero and p.grad is not None and not p.grad.any()]
        stuck, held = _stuck(params, still, loss) if still else ([], [])
    else:
        with torch.no_grad():
            second = loss()
    unchanged = [n for n, p in params
                 if torch.equal(p.detach(), before[n]) and n not in zero and n not in no_grad and n not in below]
    # each eval forward at the same seed; judged only where two without gradients agree (noise drawn in eval, a count
    # read in the forward: other checks' findings, not a weight kept from before the step)
    with train_mode(module, False):
        with seeded(ctx.device), torch.no_grad():
            plain = subject(x.clone())
        with seeded(ctx.device), torch.enable_grad():
            graded = subject(x.clone().requires_grad_(True))
        with seeded(ctx.device), torch.no_grad():
            again = subject(x.clone())
    stale = rel_diff(plain, graded) if rel_diff(again, plain) <= STALE_LIMIT / 10 else 0.0
    repeatable = True
    if not second.item() < first.item() and train:  # the copy is done with: back to its first weights, once more
        with torch.no_grad():
            for n, p in params:
                p.copy_(before[n])
            repeatable = loss().item() == first.item()
    return {"loss_before": first.item(), "loss_after": second.item(), "frozen": frozen, "frozen_share": share,
            "unchanged": unchanged, "no_grad": no_grad, "zero_grad": zero, "below_resolution": below,
            "stuck": stuck, "zeros": held, "stale": stale,
            "repeatable": repeatable, "train": train}


def _stuck(params: list[tuple[str, nn.Parameter]], still: list[str], loss) -> tuple[list[str], list[str]]:
    """Of the parameters whose gradient stayed exactly zero through a step (`still`), the all-zero ones given random
    values of the default init's scale together: those (and the others of `still`) whose gradient then comes alive,
    held at zero by each other's zeros, not by the block's structure. The zeros are put back after."""
    zeros = [n for n, p in params if n in still and p.numel() and not p.detach().any()]
    if not zeros:
        return [], []
    with parameters_replaced(dict(params), zeros, default_scale(PROBE_SEED)):
        for _, p in params:
            p.grad = None
        with torch.enable_grad():
            loss().backward()
    peak = max((p.grad.abs().max().item() for _, p in params if p.grad is not None and p.grad.numel()), default=0.0)
    alive = [n for n, p in params if n in still and p.grad is not None and p.grad.numel()
             and p.grad.abs().max().item() > STUCK_ALIVE * peak > 0]
    return alive, [n for n in zeros if n in alive]
