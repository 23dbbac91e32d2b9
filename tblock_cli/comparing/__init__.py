"""`tblock compare`: two implementations of one block with the same weights, compared, the first difference named.

`sides` builds both, `mapping` carries A's weights to B (by name, else by dataflow role), `run` compares outputs,
gradients and decoding, `localise` finds the first role output that differs, `compile` holds a block against
`torch.compile` of itself, `report` is the result as data.
"""

from __future__ import annotations
