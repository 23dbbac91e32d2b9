"""The sentences of grad_params, by kind, from its facts."""

from __future__ import annotations

from tblock_cli.messages.words import names


def _grad_params_ok(f: dict) -> str:
    note = f"; exactly zero (can be legitimate, e.g. a key bias): {names(f['zero'])}" if f["zero"] else ""
    return f"every trainable parameter gets a finite gradient{note}"


def _grad_params_piecewise(f: dict) -> str:
    moved = ", ".join(f"{n} (moves it {f['moves'][n]:.1e})" for n in f["params"])
    return (f"gradient exactly zero while the output moves with them: {moved} when each takes values at half its "
            f"scale about itself (limit {f['limit']:g}): a round, sign or argmax on the path with no straight-through "
            f"estimator, so they never train")


def _grad_params_dead(f: dict) -> str:
    told = ", ".join(f"{n} ({k} of its {total} {kind})" for n, (kind, k, total) in f["slices"].items())
    return (f"parts of a matrix no gradient ever reaches: {told}, exactly zero in training steps of other inputs "
            f"and with every parameter moved: a projection's output computed and never read (a chunk or slice "
            f"discarded), parameters that never train")


MESSAGES = {
    "grad_params.no_params": "the block has no trainable parameters",
    "grad_params.missing": lambda f: f"no gradient (defined but unused, or run under no_grad): {names(f['params'])}",
    "grad_params.random_path": lambda f: (f"no gradient in the training step read: {names(f['params'])}; each is reached "
                                          f"in a training forward at another of {f['draws']} seeds (a sublayer skipped "
                                          "at random, as LayerDrop does)"),
    "grad_params.routed_path": lambda f: (f"no gradient in the training step read: {names(f['params'])}; each is reached "
                                          f"by a training forward of one of {f['inputs']} other inputs of batch "
                                          f"{f['batch']} (an expert no token of the probe was routed to)"),
    "grad_params.nonfinite": lambda f: f"non-finite gradient: {names(f['params'])}",
    "grad_params.loss_detached": lambda f: (f"the training forward keeps {names(f['losses'])} without a graph (computed "
                                            "under no_grad or detached), and no loss it keeps or returns has one: "
                                            "added to the training loss, it trains nothing"),
    "grad_params.buffer_learns": lambda f: (f"the backward reaches {names(f['buffers'])}, registered as buffers with "
                                            f"requires_grad=True: learnable, yet no optimizer built from .parameters() "
                                            f"steps them (register them as nn.Parameter)"),
    "grad_params.ok": _grad_params_ok,
    "grad_params.piecewise": _grad_params_piecewise,
    "grad_params.dead": _grad_params_dead,
}
