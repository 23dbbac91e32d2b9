"""tblock: diagnostics for Transformer blocks: is it correct, how big is it, what does it cost?

The Python API (the `tblock` command is a client of it). Importing this package imports no torch;
each function imports it when called.

    import tblock_cli
    tblock_cli.assert_ok(tblock_cli.check(MyBlock(), d_model=64))
"""

__version__ = "0.4.0"

from tblock_cli.api import assert_ok, bench, check, compare, depth, params, spec  # noqa: E402 - after __version__, which cli reads

__all__ = ["__version__", "check", "spec", "params", "bench", "depth", "compare", "assert_ok"]
