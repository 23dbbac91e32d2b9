"""What a check costs, machine-independently: its passes over the block (and over tblock's copies of it), a forward
counted as 1 and a backward as 2 (forward-equivalents), beside its seconds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Passes:
    forward: int = 0
    backward: int = 0

    @property
    def equivalents(self) -> int:
        return self.forward + 2 * self.backward

    def __sub__(self, other: "Passes") -> "Passes":
        return Passes(self.forward - other.forward, self.backward - other.backward)

    def to_dict(self) -> dict:
        return {"forward": self.forward, "backward": self.backward, "equivalents": self.equivalents}


class PassCounter:
    """Counts forwards of a module (a forward hook) and backwards through their outputs (a gradient hook on the
    output). The hooks are closures, so `copy.deepcopy` of the module (a float64 or dropout-free copy a check makes)
    carries them and its passes count too; a copy rebuilt through the block's constructor is not counted."""

    def __init__(self, module: nn.Module):
        counts = self._counts = [0, 0]

        def backward_seen(_grad):
            counts[1] += 1

        def forward_seen(_module, _args, out):
            counts[0] += 1
            t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None) \
                if isinstance(out, (tuple, list)) else None
            if t is not None and t.requires_grad:
                try:
                    t.register_hook(backward_seen)
                except RuntimeError:  # a tensor under a functional transform takes no hook: its backward is not counted
                    pass

        self._handle = module.register_forward_hook(forward_seen)

    def now(self) -> Passes:
        return Passes(*self._counts)

    def close(self) -> None:
        self._handle.remove()


# Each check's budget in forward-equivalents on the built-in block at its defaults (the counts measured when the
# budget was set, `tblock check --json`'s `passes`): tests/test_cost.py fails when a check's count grows past it, so a
# new probe is a decision, not a drift. A check missing here has no budget yet (the test says so).
BUDGET: dict[str, int] = {
    "shape": 1, "finite": 1, "determinism": 1, "input_unchanged": 3, "grad_input": 0, "grad_params": 0,
    "train_state": 3, "residual": 18, "batch": 5, "padding": 9, "causal": 0, "order": 2, "copy": 1, "train_eval": 2,
    "attention": 1, "kv_cache": 0, "norm_placement": 0, "need_weights": 1, "dtype": 1, "ffn_share": 0,
    "tensor_parallel": 0, "fsdp": 0, "reference": 1, "norms": 0, "relative": 1, "position_bias": 0, "names": 0,
    "spec": 0, "like_reference": 0,
    # the training-time checks; meta_init's and state_dict's rebuilt instances are not counted (built by the constructor)
    "derivative": 15, "checkpointing": 11, "meta_init": 0, "state_dict": 1, "precision": 4, "optimizer_step": 4,
}


def budget_table() -> str:
    """The budget table of docs/performance.md, from BUDGET (a test keeps the two equal)."""
    rows = ["| check | budget (forward-equivalents, built-in block) |", "|---|---|"]
    rows += [f"| `{name}` | {n} |" for name, n in BUDGET.items()]
    rows.append(f"| **battery** | **{sum(BUDGET.values())}** |")
    return "\n".join(rows)
