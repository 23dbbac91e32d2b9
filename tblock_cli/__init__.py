"""tblock: diagnostics for Transformer blocks: is it correct, how big is it, what does it cost?

The Python API (the `tblock` command is a client of it). Importing this package imports no torch;
each function imports it when called.

    import tblock_cli
    tblock_cli.assert_ok(tblock_cli.check(MyBlock(), d_model=64))
"""

__version__ = "0.4.0"
__all__ = ["__version__", "check", "params", "bench", "depth", "compare", "assert_ok"]


def check(block=None, **options):
    """Run the check battery on `block` (an nn.Module, a zero-argument factory, a SPEC string, or None for the
    built-in block) with the CLI's option names (d_model, n_heads, seq, batch, causal, dtype, strict, ...).
    Returns a CheckReport: `.ok`, `.checks`, `.to_dict()` (what `tblock check --json` prints)."""
    from tblock_cli import api
    from tblock_cli.errors import exits_guarded
    from tblock_cli.runtime import kept_rng

    with kept_rng(), exits_guarded():
        return api.check(block, **options)


def params(block=None, **options):
    """Parameters, bytes and FLOPs per component by dataflow role (tree_depth=N for the module tree); a ParamReport."""
    from tblock_cli import api
    from tblock_cli.errors import exits_guarded
    from tblock_cli.runtime import kept_rng

    with kept_rng(), exits_guarded():
        return api.params(block, **options)


def bench(block=None, **options):
    """Latency, peak memory and attention kernel (seq, mode, need_weights, decode, breakdown, ...); a BenchReport."""
    from tblock_cli import api
    from tblock_cli.errors import exits_guarded
    from tblock_cli.runtime import kept_rng

    with kept_rng(), exits_guarded():
        return api.bench(block, **options)


def depth(block=None, **options):
    """A stack of `layers` copies at init: per-layer scale, gradients, residual gain, norm placement; a DepthReport."""
    from tblock_cli import api
    from tblock_cli.errors import exits_guarded
    from tblock_cli.runtime import kept_rng

    with kept_rng(), exits_guarded():
        return api.depth(block, **options)


def compare(a=None, b=None, **options):
    """Two implementations of one block (SPECs, modules, or "builtin" for the built-in block; A may also be None)
    with A's weights carried to B; B is None only with compile=True: outputs, gradients and decoding compared, the first differing role output named.
    Options: the shared size flags, kwargs_a, kwargs_b, dtype_b, atol, rtol, map_file; compile=True holds A
    against torch.compile(A), on backend= inductor, aot_eager or eager. Returns a CompareReport: `.ok`, `.findings`, `.to_dict()`."""
    from tblock_cli import api
    from tblock_cli.errors import exits_guarded
    from tblock_cli.runtime import kept_rng

    with kept_rng(), exits_guarded():
        return api.compare(a, b, **options)


def assert_ok(report) -> None:
    """Raise AssertionError listing what made a report not ok: failing checks, a bench regression, depth warnings
    under strict. Every report (check, params, bench, depth) works; anything else is a ConfigError (and a TypeError)."""
    from tblock_cli import api

    api.assert_ok(report)
