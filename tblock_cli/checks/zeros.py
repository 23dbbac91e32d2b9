"""Weights that start at exactly zero hide what they multiply: a zero output projection (nanochat, modded-nanogpt,
GPT-NeoX's and T-Fixup's inits), a ReZero gate, adaLN-zero's modulation, a LoRA B. At such an init the block is the
identity on its stream, and a check that compares outputs (causal, batch, padding, kv_cache, order) compares x with x:
it passes whatever attention computes. A property of the architecture holds at every weight training reaches, so the
battery runs with those weights drawn at random, and says so; the checks about the init itself see it as built."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from tblock_cli.probes import parameters_replaced

# The draw's seed: the same values on every run.
DRAW_SEED = 4321


def hiding_zeros(module: nn.Module) -> list[str]:
    """Trainable floating parameters that are exactly zero everywhere and hide something: a matrix (whatever it maps is
    lost) or a single gate. A vector of zeros is left as built: it is almost always a bias or a norm's offset, which adds
    to the stream instead of hiding it (and a key bias's zero is the structure's, not the init's)."""
    return [n for n, p in module.named_parameters()
            if p.requires_grad and p.is_floating_point() and p.numel() and (p.dim() >= 2 or p.numel() == 1)
            and not bool(p.detach().any())]


def default_scale(seed: int = DRAW_SEED):
    """fn(name, p): uniform +-1/sqrt(fan_in) (nn.Linear's default scale; a gate: +-1), drawn in float64 from `seed`."""
    gen = torch.Generator().manual_seed(seed)

    def drawn(_name, p):
        bound = 1.0 / max(1, p.shape[-1] if p.dim() > 1 else p.numel()) ** 0.5
        return (torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(bound).to(p)

    return drawn


@contextmanager
def drawn_at_random(module: nn.Module, names: list[str]):
    """Parameters `names` hold random values of the default init's scale for a while (put back after)."""
    with parameters_replaced(dict(module.named_parameters()), names, default_scale()):
        yield


@contextmanager
def as_built(module: nn.Module, names: list[str]):
    """Parameters `names` back at zero for a while, inside `drawn_at_random` (the draws put back after)."""
    with parameters_replaced(dict(module.named_parameters()), names, lambda _n, p: torch.zeros_like(p)):
        yield


def zeros_note(names: list[str], what: str, tail: str = "") -> str:
    """The run's note: which weights were drawn, and for what."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{len(names)} trainable weight(s) start at exactly zero ({shown}), which hides what they multiply: {what} "
            f"with them drawn at random (+-1/sqrt(fan_in)){tail}")
