"""`tblock compare`: two implementations of one block with the same weights, compared, the first difference named.

`sides` builds both, `mapping` carries A's weights to B (by name, else by dataflow role), `run` compares outputs,
gradients and decoding, `localise` finds the first role output that differs, `compile` holds a block against
`torch.compile` of itself, `report` is the result as data.
"""

from __future__ import annotations

# torch.compile backends compare can hold A against, cheapest last: inductor generates and builds kernels,
# aot_eager runs dynamo's graphs through AOTAutograd with eager kernels, eager runs dynamo's graphs as they are.
# Stepping down the list says whether a difference comes from inductor's kernels, from autograd tracing or from
# dynamo itself.
BACKENDS = ("inductor", "aot_eager", "eager")


def check_backend(backend: str | None, compile: bool) -> None:
    """--backend: one of BACKENDS, and only with --compile (judged before torch is imported)."""
    from tblock_cli.errors import ConfigError

    if backend is None:
        return
    if not compile:
        raise ConfigError("--backend picks torch.compile's backend: it needs --compile")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
