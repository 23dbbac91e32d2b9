"""A block's anatomy: the tracer (`tracer`), what attention and norms look like (`attention`, `mha`, `norms`),
and the roles and rows the dataflow gives each module (`roles`, `dataflow`)."""

from tblock_cli.anatomy.dataflow import Dataflow, predicted_ffn_share, trace
from tblock_cli.anatomy.roles import GROUPS

__all__ = ["Dataflow", "GROUPS", "predicted_ffn_share", "trace"]
