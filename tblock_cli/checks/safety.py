"""Checks that the block survives what training and tools do to it: a second forward + backward, and a deepcopy."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tblock_cli.checks.context import TRAINING_BACKWARD, Context, eval_forward, projected
from tblock_cli.checks.graphs import reaches
from tblock_cli.checks.result import Outcome, failed, passed, warned
from tblock_cli.errors import is_out_of_memory, one_line
from tblock_cli.probes import BOOKKEEPING, held_tensors, module_copy, rel_diff, state_key, tensors, train_mode
from tblock_cli.report import Status


def held_with_history(module: nn.Module, inputs: set[int]) -> list[str]:
    """Tensors the module keeps (buffers, plain attributes, lists/dicts of them) whose graph reaches the input; a loss
    kept for the trainer to add (`self.aux_loss`, fairseq's `l_aux`: gradients.kept_losses) is meant to keep its graph
    until the step's backward, and is not one."""
    from tblock_cli.checks.gradients import kept_losses

    losses = {id(t) for t in kept_losses(module).values()}
    return sorted({where for where, t in held_tensors(module) if id(t) not in losses and reaches(t.grad_fn, inputs)})


def check_train_state(ctx: Context) -> Outcome:
    """Two train forwards + backwards in a row (a training loop's first two steps); then no module state with a graph.
    The first step is the training backward the gradient checks ran, when nothing has run the block since.

    Catches: a second train forward + backward that fails (module state written in a training forward keeps the
    first graph); a backward that writes module state the forward wrote, with other values (a checkpoint inside the
    block recomputes the forward: a balance loss appended twice, a count advanced twice); a training step that fails
    after an eval forward under `torch.inference_mode()` (`trainer.validate()` before `fit()`, an eval loop under
    `@torch.inference_mode()`: a cos/sin or mask cache built then is an inference tensor that autograd refuses to
    save) and tensors the module keeps that carry autograd history are a
    **warning**; an eval forward under `torch.inference_mode()` that differs from one under `no_grad` (a path taken
    in inference mode only: `torch.is_inference_mode_enabled()`); parameters that required grad as the block was
    built and no longer do after the battery's eval() and train() switches and forwards (an eval() override that
    freezes them, a forward that does: the loop after a validation trains nothing)"""
    module = ctx.subject.module
    saved = {n: p.grad for n, p in module.named_parameters()}
    done = ctx.noted(TRAINING_BACKWARD)  # the gradient checks' training backward, if one ran
    first = (done.x, done.key) if done is not None and done.key == state_key(module) else None
    kept = [first[0]] if first else []  # the inputs stay alive so their ids stay theirs
    rewritten: list[str] = []
    inputs: set[int] = {id(x) for x in kept}
    try:
        with train_mode(module, True), torch.enable_grad():
            for step in (2,) if first else (1, 2):  # noqa: B007 - the failing step is reported
                x = ctx.x().requires_grad_(True)  # as embeddings are: state computed from x then holds x's graph
                inputs.add(id(x))
                kept.append(x)
                before = named_state(module)
                out = ctx.subject(x.clone())
                loss = projected(ctx, out)
                forward = named_state(module)
                kept_then = {k: _contents(v) for k, v in forward.items() if before.get(k, (None,))[0] != v[0]}
                if loss.requires_grad:
                    loss.backward()
                rewritten = rewritten or written_twice(forward, named_state(module), kept_then)
    except RuntimeError as e:
        return failed("train_state.second_backward", step, step=step, error=one_line(e), held=held_with_history(module, inputs))
    finally:
        for n, p in module.named_parameters():
            p.grad = saved[n]
    frozen = [n for n, p in module.named_parameters() if n in ctx.trained_at_start and not p.requires_grad]
    if frozen:  # the battery's eval and train switches (and forwards) left them frozen: a loop after eval() trains none
        return failed("train_state.frozen", len(frozen), frozen=frozen[:8])
    if rewritten:  # a recompute in the backward ran the forward's writes again
        return failed("train_state.recompute_writes", len(rewritten), written=rewritten[:8])
    run = after_inference(ctx)
    if run.differs is not None and run.differs > ctx.tol and "deterministic" not in ctx.unmet:  # noise in eval: determinism
        # the training steps ran: the checks that need them still run
        return Outcome(Status.FAIL, "train_state.inference_path", run.differs, {"diff": run.differs, "limit": ctx.tol},
                       unmet=False)
    if run.kept is not None:  # a warning: Lightning's fit() validates under no_grad; validate() first, or one's own
        return warned("train_state.inference_state", len(run.kept), kept=run.kept, error=run.error)
    held = held_with_history(module, inputs)
    if held:
        return warned("train_state.history", len(held), held=held)
    return passed("train_state.clean", 0)


def named_state(module: nn.Module) -> dict[str, tuple]:
    """Each module's buffers and attributes by name (a dict's by entry), as (signature, contents): a tensor's
    identity and version, a list's or tuple's length and its tensors' identities and versions, a plain scalar's value;
    the contents are the tensors themselves (or the scalar). Parameters are left out (an optimizer writes them, never a forward that
    keeps to its job; the battery's other checks judge writes to them), and so are torch's own norms' running
    statistics: a BatchNorm recomputed in the backward updates them again, as torch documents (checkpointing's
    `state_after` leaves them out for the same reason)."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            continue
        for key, value in kept_items(m):
            where = f"{name}.{key}" if name else key
            if isinstance(value, dict):  # by entry: a backward that adds its own entries (gradient statistics beside
                # the forward's activation statistics) writes nothing the forward wrote
                for k, v in value.items():
                    _entry(out, f"{where}[{k!r}]", v)
            else:
                _entry(out, where, value)
    return out


def kept_items(m: nn.Module) -> list[tuple[str, object]]:
    """(name, value) of what one module keeps besides its parameters and children's registry: its buffers, then its
    own attributes (private ones too, `_cos`), torch's bookkeeping left out."""
    own = [(k, v) for k, v in vars(m).items() if k not in BOOKKEEPING and k not in ("_parameters", "_buffers", "_modules")]
    return [*((k, b) for k, b in m._buffers.items() if b is not None), *own]


def _entry(out: dict, where: str, value) -> None:
    if isinstance(value, (torch.Tensor, list, tuple, dict)):
        held = list(tensors(value))
        size = len(value) if isinstance(value, (list, tuple, dict)) else None
        out[where] = ((size, *((id(t), t._version) for t in held)), held)
    elif isinstance(value, (bool, int, float, str, type(None))):
        out[where] = ((value,), value)


def _contents(entry: tuple):
    """What an entry of named_state holds, copied: its tensors' values (detached clones) or its scalar."""
    sig, held = entry
    return (sig[0], [t.detach().clone() for t in held]) if isinstance(held, list) else held


def _same_contents(a, b) -> bool:
    """Equal contents (from `_contents`); tensors that cannot be compared (meta, or on two devices) count as equal:
    no finding without evidence."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        try:
            return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
                x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[1], b[1]))
        except RuntimeError:
            return True
    return type(a) is type(b) and a == b


def written_twice(forward: dict, after: dict, kept: dict) -> list[str]:
    """The state a training forward wrote (`kept`: its contents right after the forward, from `_contents`) that its
    backward wrote again with other contents (forward -> after): a recompute of the forward inside the backward that
    appends, counts or updates once more. State written only in the backward (a gradient hook's statistics), and state
    the recompute writes again with the same values (a mask rebuilt, probabilities kept for a plot), is not this."""
    return sorted(k for k in kept if k in after and after[k][0] != forward[k][0]
                  and not _same_contents(_contents(after[k]), kept[k]))


@dataclass(frozen=True)
class InferenceRun:
    """A fresh instance's eval forwards under torch.inference_mode and no_grad: the largest relative difference of the
    two after the first call (None where not run), and where a training step then raised on an inference tensor, the
    tensors the module keeps made in inference mode and the error."""

    differs: float | None = None
    kept: list | None = None
    error: str | None = None


def after_inference(ctx: Context) -> InferenceRun:
    """On a fresh instance (caches a forward builds lazily not yet built; a copy of the block where it was handed over
    built): an eval forward under torch.inference_mode, one under no_grad and one more under inference mode (a path
    taken under inference mode only shows as the last two's difference), then a training forward + backward. Not
    above the training checks' size; the caller's random state is put back after."""
    from tblock_cli.checks.training import copied, seeded, too_large

    if too_large(ctx) is not None:
        return InferenceRun()
    x = ctx.standard()[0]
    with seeded(ctx.device):
        try:
            rebuild = ctx.subject.rebuild
            twin = rebuild(ctx.cfg.seed + 1, "cpu").to(ctx.device) if rebuild is not None else copied(ctx.subject.module)
            subject = ctx.subject.like(twin)
            with torch.inference_mode(), train_mode(twin, False):
                subject(x.clone())
            # compared after that first call (a data-dependent init, ActNorm's, sets itself in the first forward)
            with torch.no_grad(), train_mode(twin, False):
                plain = subject(x.clone())
            with torch.inference_mode(), train_mode(twin, False):
                differs = rel_diff(subject(x.clone()), plain)
        except Exception as e:  # noqa: BLE001 - a block not built again, or not run under inference mode: not this
            if is_out_of_memory(e):
                raise
            return InferenceRun()
        try:
            with train_mode(twin, True), torch.enable_grad():
                out = subject(x.clone().requires_grad_(True))
                out.float().sum().backward()
        except Exception as e:  # noqa: BLE001 - only autograd's refusal of an inference tensor is this finding
            if is_out_of_memory(e):
                raise
            if "nference tensor" in str(e):
                return InferenceRun(differs, inference_state(twin), one_line(e))
    return InferenceRun(differs)


def inference_state(module: nn.Module) -> list[str]:
    """Names of the tensors a module keeps (buffers, attributes, `_cos` too, lists/dicts of them) made in inference
    mode."""
    kept = []
    for name, m in module.named_modules():
        for key, value in kept_items(m):
            if any(t.is_inference() for t in tensors(value)):
                kept.append(f"{name}.{key}" if name else key)
    return sorted(set(kept))


class ParamUse(TorchFunctionMode):
    """Notes which of a set of tensors (the original's parameters and buffers) a forward touches."""

    def __init__(self, watched: dict[int, str]):
        super().__init__()
        self.watched, self.touched = watched, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tensors((args, kwargs or {})):
            if id(t) in self.watched:
                self.touched.add(self.watched[id(t)])
        return func(*args, **(kwargs or {}))


def storage_sharing_memo(module: nn.Module) -> dict[int, torch.Tensor]:
    """A deepcopy memo that gives the copy new parameter and buffer objects over the original's storage: what the check
    judges is which objects the copy's forward touches (ids), and copying the values (0.8 GB at a 7B-size layer)
    would add nothing to that. Everything else (submodules, closures, plain tensor attributes) is copied as usual."""
    memo: dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
        else:
            memo[id(t)] = t.detach()
    return memo


def check_copy(ctx: Context) -> Outcome:
    """A deepcopy is a faithful copy: its forward touches none of the original's modules, parameters or buffers.

    Catches: a `deepcopy` that is not faithful: the copy's forward calls the original's modules or reads its
    parameters (a closure or a lambda capturing a submodule), or the copy raises. A tensor kept from the last training
    forward with its graph (an auxiliary loss, as fairseq's and DeepSpeed's MoE layers keep `l_aux`), which deepcopy
    refuses until the next forward, is copied detached and named, not failed"""
    module = ctx.subject.module
    held: list[str] = []
    try:
        twin = copy.deepcopy(module, storage_sharing_memo(module))
    except Exception as e:  # noqa: BLE001 - the copy itself fails: say why
        held = list(dict.fromkeys(where for where, _ in held_tensors(module)))
        try:
            if not held:
                raise
            twin = module_copy(module, storage_sharing_memo(module))
        except Exception:  # noqa: BLE001
            return failed("copy.raises", None, error=one_line(e))
    called: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda _m, _a, _n=n: called.append(_n or "(root)"))
             for n, m in module.named_modules()]
    watched = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    use = ParamUse(watched)
    try:
        with use:
            got = eval_forward(ctx, ctx.x(), subject=ctx.subject.like(twin))
    finally:
        for h in hooks:
            h.remove()
    shared = sorted(set(called) | use.touched)
    if shared:
        return failed("copy.unfaithful", len(shared), shared=shared)
    return passed("copy.faithful_held" if held else "copy.faithful", 0, shape=list(got.shape), held=held)
