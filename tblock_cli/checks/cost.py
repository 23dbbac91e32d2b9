"""What a check costs, machine-independently: its passes over the block (and over tblock's copies of it), a forward
counted as 1 and a backward as 2 (forward-equivalents), beside its seconds."""

from __future__ import annotations

from dataclasses import dataclass


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
    """Counts the forwards through a subject's calling convention (and every `like` copy of it: a float64 or
    dropout-free copy a check makes) and the backwards through their outputs, and the cached decoding steps a check
    reports with Subject.ran (each reads all the weights, as a forward does). A module called some other way (a copy
    rebuilt through the block's constructor and called directly) is not counted."""

    def __init__(self, subject):
        if subject.passes is None:
            subject.passes = [0, 0]
        self._counts = subject.passes
        self._subject = subject

    def now(self) -> Passes:
        return Passes(*self._counts)

    def close(self) -> None:
        self._subject.passes = None


# Each check's budget in forward-equivalents on the built-in block at its defaults (the counts measured when the
# budget was set, `tblock check --json`'s `passes`): tests/test_cost.py fails when a check's count grows past it, so a
# new probe is a decision, not a drift. A check missing here has no budget yet (the test says so).
BUDGET: dict[str, int] = {
    "shape": 2, "finite": 3, "determinism": 1, "input_unchanged": 3, "grad_input": 0, "grad_params": 0,
    "train_state": 9, "residual": 20, "batch": 5, "padding": 9, "causal": 0, "order": 2, "copy": 1, "train_eval": 2, "dropout": 5,
    "attention": 1, "kv_cache": 0, "norm_placement": 0, "need_weights": 1, "dtype": 1, "ffn_share": 0,
    "tensor_parallel": 0, "fsdp": 0, "reference": 1, "norms": 0, "relative": 1, "position_bias": 0, "names": 0,
    "spec": 0, "like_reference": 0,
    "derivative": 15, "checkpointing": 11, "meta_init": 1, "state_dict": 2, "precision": 7, "optimizer_step": 8,
    "grad_accumulation": 10, "history": 8, "device": 3, "global_state": 4,
}


def budget_table() -> str:
    """The budget table of docs/performance.md, from BUDGET (a test keeps the two equal)."""
    rows = ["| check | budget (forward-equivalents, built-in block) |", "|---|---|"]
    rows += [f"| `{name}` | {n} |" for name, n in BUDGET.items()]
    rows.append(f"| **battery** | **{sum(BUDGET.values())}** |")
    return "\n".join(rows)
