"""A block eager against `torch.compile` of itself: outputs and gradients, graph breaks with their reasons,
recompilation when the sequence length changes."""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from tblock_cli.errors import one_line
from tblock_cli.probes import module_copy, rel_diff, same_draws, train_mode, zero_dropout

# Inductor's CPU kernels are C++ built at run time; without a compiler it cannot run there.
CXX = ("g++", "c++", "clang++", "gcc", "cc")
# A compiled graph reorders float reductions (fused kernels): measured 0.0 to ~1e-6 relative on the
# built-in block and nn.TransformerEncoderLayer; 1e-4 keeps float32 margin without hiding a wrong op.
COMPILE_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}


def compiler() -> str | None:
    return next((c for c in CXX if shutil.which(c)), None)


PACKAGE = Path(__file__).resolve().parent.parent  # tblock_cli/


def graph_breaks(subject, x: torch.Tensor) -> dict:
    """torch._dynamo.explain on one eval forward: graphs, breaks and each break's reason and place."""
    import torch._dynamo

    torch._dynamo.reset()
    with train_mode(subject.module, False), torch.no_grad():
        ex = torch._dynamo.explain(lambda t: subject(t))(x.clone())
    reasons = []
    for r in ex.break_reasons:
        stack = getattr(r, "user_stack", None) or []
        if any(_ours(f.filename) for f in stack):
            continue  # tblock's own driving (hooks registered to swap its input into a model's layers): not the block's
        frame = stack[-1] if stack else None
        reasons.append({"reason": str(r.reason).strip().splitlines()[0] if str(r.reason).strip() else "",
                        "where": f"{frame.filename}:{frame.lineno}" if frame is not None else None})
    # A break with no reason is a frame boundary of the code around the block (an hf: layer's wrapper computing the
    # model's masks and rotary tables apart: 2 for hf:llama, where transformers' own one-layer model has none), not
    # the block's: only breaks dynamo gives a reason for are counted, and none that tblock's own code makes.
    return {"graphs": ex.graph_count, "graph_breaks": len(reasons), "reasons": reasons}


def _ours(filename: str) -> bool:
    """A frame in tblock's own package (its wrappers), not in the block under test."""
    return Path(filename).resolve().is_relative_to(PACKAGE)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextmanager
def quiet_dynamo():
    """Dynamo logs each graph break as a warning with a stack; the report carries the reasons instead."""
    log = logging.getLogger("torch._dynamo")
    was = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(was)


def run_compile(subject, cfg, x: torch.Tensor, v: torch.Tensor, backend: str | None = None) -> dict:
    """The compile section: backend, equality of outputs and gradients, graph breaks, recompiles by seq."""
    with quiet_dynamo():
        return compile_and_compare(subject, x, v, backend)


def compile_and_compare(subject, x: torch.Tensor, v: torch.Tensor, backend: str | None = None) -> dict:
    """backend None: inductor where it can build kernels (a GPU, or a C++ compiler for the CPU), else aot_eager."""
    import torch._dynamo

    cxx = compiler()
    if backend is None:
        backend = "inductor" if cxx or x.device.type != "cpu" else "aot_eager"
    tol = COMPILE_TOLERANCE[x.dtype]
    out = {"backend": backend, "cxx": cxx, "tolerance": tol}
    stack = ExitStack()
    try:
        out.update(graph_breaks(subject, x))
        torch._dynamo.reset()
        # The block's own dropout, zeroed in both (put back in the caller's after): eager and compiled kernels draw
        # different masks from one seed, so with dropout on the gradients could never agree.
        stack.enter_context(zero_dropout(subject.module))
        twin = subject.like(module_copy(subject.module))
        compiled = torch.compile(twin.module, backend=backend)
        fast = subject.like(compiled)
        with train_mode(subject.module, False), train_mode(compiled, False), torch.no_grad():
            eager_y, comp_y = subject(x.clone()), fast(x.clone())
        out["outputs"] = rel_diff(comp_y, eager_y)
        before = unique_graphs()
        grads = []
        for s in (subject, fast):
            xi = x.detach().clone().requires_grad_(True)
            with train_mode(s.module, True), same_draws(x.device), torch.enable_grad():
                (s(xi) * v).float().sum().backward()
            grads.append(xi.grad)
        out["input_grad"] = rel_diff(grads[1], grads[0])
        pa = dict(subject.module.named_parameters())
        worst = 0.0
        for name, p in twin.module.named_parameters():
            if p.grad is not None and pa[name].grad is not None:
                worst = max(worst, rel_diff(p.grad, pa[name].grad))
            pa[name].grad, p.grad = None, None
        out["param_grads"] = worst
        out["train_graphs"] = unique_graphs() - before  # train mode is another guard: a graph of its own
        recompiles = []
        with train_mode(compiled, False), torch.no_grad():
            for extra in (1, 2):  # the first change marks seq dynamic (one recompile); the second should reuse it
                start = unique_graphs()
                fast(torch.randn(x.shape[0], x.shape[1] + extra, x.shape[2], dtype=x.dtype, device=x.device))
                recompiles.append({"seq": x.shape[1] + extra, "new_graphs": unique_graphs() - start})
        out["recompiles"] = recompiles
        out["equal"] = max(out["outputs"], out["input_grad"], out["param_grads"]) <= tol
    except Exception as e:  # noqa: BLE001 - a block dynamo cannot compile is a finding, not a crash
        out["error"] = one_line(e)
        out["equal"] = False
    finally:
        stack.close()
        torch._dynamo.reset()
    return out
