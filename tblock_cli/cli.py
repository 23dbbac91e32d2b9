"""The `tblock` command line: parse flags, hand off to one computation, render, exit with a code."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Annotated, Optional

import typer
from rich.console import Console

from tblock_cli import __version__
from tblock_cli.errors import TBlockError

app = typer.Typer(
    name="tblock",
    help="Diagnostics for Transformer blocks: is it correct (check), how big is it (params), what does it cost (bench), how does it stack (depth)?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

BLOCK = "Block (shared by every command)"
RUN = "Input and device"

# Shared flags. None means "not given", so a --preset's value can stand unless a flag overrides it.
DModel = Annotated[Optional[int], typer.Option("--d-model", help="Width of the residual stream. (default: 512)", rich_help_panel=BLOCK, show_default=False)]
NHeads = Annotated[Optional[int], typer.Option("--n-heads", help="Attention heads; must divide --d-model. (default: 8)", rich_help_panel=BLOCK, show_default=False)]
DFF = Annotated[Optional[int], typer.Option("--d-ff", help="FFN hidden width. (default: 4 x d_model)", rich_help_panel=BLOCK, show_default=False)]
Dropout = Annotated[Optional[float], typer.Option("--dropout", help="Dropout probability, in [0, 1). (default: 0.1)", rich_help_panel=BLOCK, show_default=False)]
Norm = Annotated[Optional[str], typer.Option("--norm", help="LayerNorm placement: pre (x + f(LN(x))) or post (LN(x + f(x))). (default: pre)", rich_help_panel=BLOCK, show_default=False)]
Activation = Annotated[Optional[str], typer.Option("--activation", help="FFN activation: gelu or relu. (default: gelu)", rich_help_panel=BLOCK, show_default=False)]
Eps = Annotated[Optional[float], typer.Option("--eps", help="LayerNorm eps; 0 is allowed but warned (NaN on a constant token). (default: 1e-05)", rich_help_panel=BLOCK, show_default=False)]
Bias = Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="Biases in Linear and LayerNorm layers. (default: --bias)", rich_help_panel=BLOCK, show_default=False)]
Causal = Annotated[Optional[bool], typer.Option("--causal/--no-causal", help="Causal attention mask. (default: --no-causal)", rich_help_panel=BLOCK, show_default=False)]
Layers = Annotated[Optional[int], typer.Option("--layers", help="Blocks in the stack; a Pre-LN stack gets a final LayerNorm. (default: 1)", rich_help_panel=BLOCK, show_default=False)]
Preset = Annotated[Optional[str], typer.Option("--preset", help="A well-known shape (see `tblock params --list-presets`); explicit flags override it.", rich_help_panel=BLOCK, show_default=False)]
Batch = Annotated[Optional[int], typer.Option("--batch", help="Samples per input. (default: 2)", rich_help_panel=RUN, show_default=False)]
Seq = Annotated[Optional[int], typer.Option("--seq", help="Tokens per sample. (default: 10)", rich_help_panel=RUN, show_default=False)]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32, float16 or bfloat16. (default: float32)", rich_help_panel=RUN, show_default=False)]
Device = Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps; auto = cuda when present. (default: auto)", rich_help_panel=RUN, show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seeds weights and inputs. (default: 0)", rich_help_panel=RUN, show_default=False)]
BlockSpec = Annotated[Optional[str], typer.Option("--block", help="Your own block: package.module:NAME or path/to/file.py:NAME (a class or a factory).", rich_help_panel=BLOCK, show_default=False)]
Kwargs = Annotated[Optional[str], typer.Option("--kwargs", help="More constructor keywords for --block, as a JSON object.", rich_help_panel=BLOCK, show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]

out = Console()
err = Console(stderr=True)


def _version(value: bool):
    if value:
        print(f"tblock {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
):
    """Diagnostics for Transformer blocks."""


@contextmanager
def user_errors():
    """The edge: a TBlockError (or running out of memory) becomes one line on stderr and its exit code."""
    try:
        yield
    except TBlockError as e:
        _say("error", str(e))
        raise typer.Exit(e.exit_code) from None
    except MemoryError:
        _say("error", "out of memory; reduce --batch, --seq, --d-model or --layers")
        raise typer.Exit(2) from None
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            raise
        _say("error", "the device ran out of memory; reduce --batch, --seq, --d-model or --layers")
        raise typer.Exit(2) from None


def _say(kind: str, message: str) -> None:
    """One line on stderr; the message is plain text (no markup or emoji codes: specs contain colons)."""
    from rich.text import Text

    err.print(Text.assemble((f"{kind}: ", "bold red" if kind == "error" else "yellow"), message), soft_wrap=True)


FLAGS = ("d_model", "n_heads", "d_ff", "dropout", "norm", "activation", "eps", "bias", "causal", "layers", "batch",
         "seq", "dtype", "device", "seed")


def _flags(values: dict, **override) -> dict:
    """The shared block flags out of a command's arguments (its locals()), with overrides."""
    return {**{k: values[k] for k in FLAGS if k in values}, **override}


# Flags that shape only the built-in block: a user block gets d_model, n_heads, d_ff, dropout and
# causal through its constructor's signature, and anything else through --kwargs.
BUILTIN_ONLY = ("norm", "activation", "eps", "bias")


def _warn_builtin_only(block, flags: dict, *, layers_apply: bool = False) -> None:
    given = [k for k in BUILTIN_ONLY + (() if layers_apply else ("layers",)) if flags.get(k) is not None]
    if block is not None and given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        _say("warning", f"{names} shape(s) only the built-in block; {block} is built from its own code (pass its arguments with --kwargs)")


def _setup(preset, block, kwargs, *, allow_mixed=False, same_shape=True, **flags):
    """Flags -> validated config, device, dtype and the subject; warnings to stderr."""
    from tblock_cli.config import build_config

    _warn_builtin_only(block, flags)
    cfg = build_config(preset, allow_mixed=allow_mixed, **flags)
    for w in cfg.warnings:
        _say("warning", w)
    from tblock_cli import runtime
    from tblock_cli.loading import make_subject

    device = runtime.resolve_device(cfg.device)
    dtype = runtime.resolve_dtype(cfg.dtype, device)
    return cfg, device, dtype, (lambda: make_subject(cfg, device, dtype, block, kwargs, same_shape=same_shape))


@app.command()
def check(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None, batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None,
    seed: Seed = None, block: BlockSpec = None, kwargs: Kwargs = None,
    strict: Annotated[bool, typer.Option("--strict", help="Treat warnings as failures.")] = False,
    json_: Json = False,
):
    """Run the diagnostic battery on a block. Exit 0 when nothing fails, 1 when a check fails or errors, 2 on bad input."""
    with user_errors():
        cfg, dev, dt, make = _setup(preset, block, kwargs, same_shape=False, **_flags(locals()))
        from tblock_cli import runtime
        from tblock_cli.checks import run_checks

        runtime.ensure_fits(runtime.estimate_bytes(cfg, copies=1), dev, "check")
        subject = make()
        with err.status("checking", spinner="dots") as status:
            report = run_checks(subject, cfg, dev, dt, strict=strict, progress=lambda name: status.update(f"check: {name}"))
    env = runtime.environment(dev, dt)
    from tblock_cli import render

    if json_:
        config = {**cfg.as_dict(), "block": block or "built-in", "kwargs": kwargs}
        print(render.dumps({"ok": report.ok, "config": config, "environment": env, "checks": report.checks}))
    else:
        out.print(render.check_view(report, subject.name, env))
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def params(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None, batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None,
    seed: Seed = None, block: BlockSpec = None, kwargs: Kwargs = None,
    depth: Annotated[int, typer.Option("--depth", min=1, help="With --block: how deep into the module tree the rows go.")] = 1,
    list_presets: Annotated[bool, typer.Option("--list-presets", help="List the --preset shapes and exit.")] = False,
    json_: Json = False,
):
    """Parameters, bytes and FLOPs per component (LayerNorms, attention projections, FFN), and the FFN's share."""
    if list_presets:
        from tblock_cli.config import PRESETS

        if json_:
            print(json.dumps(PRESETS, indent=2))
        else:
            from tblock_cli import render

            out.print(render.presets_view(PRESETS))
        raise typer.Exit(0)
    with user_errors():
        cfg, dev, dt, make = _setup(preset, block, kwargs, **_flags(locals()))
        from tblock_cli import runtime
        from tblock_cli.params import param_report

        if block is not None:  # its FLOPs are counted by running it once
            runtime.ensure_fits(runtime.estimate_bytes(cfg), dev, "params")
        subject = make() if block is not None else _counting_subject(cfg, dt)
        report = param_report(subject, cfg, dt, depth)
    from tblock_cli import render

    if json_:
        print(render.dumps({**render.params_json(report), "config": {**cfg.as_dict(), "block": block or "built-in"}}))
    else:
        out.print(render.params_view(report))


def _parse_seqs(text: str) -> list[int]:
    from tblock_cli.errors import ConfigError

    try:
        seqs = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"--seq takes a comma-separated list of integers, e.g. 128,512; got {text!r}") from None
    if not seqs or any(s <= 0 for s in seqs):
        raise ConfigError(f"--seq values must be > 0, got {text!r}")
    return sorted(set(seqs))


@app.command()
def bench(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Samples per input. (default: 2)", rich_help_panel=RUN, show_default=False)] = None,
    seq: Annotated[str, typer.Option("--seq", help="Sequence lengths to sweep, comma-separated.", rich_help_panel=RUN)] = "128,512",
    dtype: Dtype = None, device: Device = None, seed: Seed = None, block: BlockSpec = None, kwargs: Kwargs = None,
    need_weights: Annotated[bool, typer.Option("--need-weights", help="Measure every nn.MultiheadAttention with need_weights forced on and off.")] = False,
    mode: Annotated[str, typer.Option("--mode", help="infer (eval, inference_mode, forward), train (forward + backward) or both.")] = "both",
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="torch: also time nn.TransformerEncoderLayer of the same shape, and print the ratio.", show_default=False)] = None,
    min_time: Annotated[float, typer.Option("--min-time", help="Seconds of timed calls per measurement.")] = 0.5,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Save a chart to FILE.png or FILE.svg (needs pip install 'tblock[plot]').", show_default=False)] = None,
    json_: Json = False,
):
    """Latency (median, IQR), peak memory and the attention kernel that ran; with --need-weights, both ways."""
    with user_errors():
        from tblock_cli.errors import ConfigError

        seqs = _parse_seqs(seq)
        if mode not in ("infer", "train", "both"):
            raise ConfigError(f"--mode must be infer, train or both, got {mode!r}")
        if baseline not in (None, "torch"):
            raise ConfigError(f"--baseline takes 'torch', got {baseline!r}")
        if min_time <= 0:
            raise ConfigError(f"--min-time must be > 0, got {min_time}")
        if plot is not None:
            _check_plot_target(plot)
        cfg, dev, dt, make = _setup(preset, block, kwargs, **_flags(locals(), seq=seqs[0]))
        from tblock_cli.bench import check_sizes, plan, run_bench

        modes = ["infer", "train"] if mode == "both" else [mode]
        check_sizes(cfg, seqs, modes, dev)
        subject = make()
        total = len(plan(cfg, seqs, modes, need_weights, baseline == "torch"))
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("measuring", total=total)
            seen = {"n": 0}

            def step(desc):
                bar.update(task, completed=seen["n"], description=f"measuring {desc}")
                seen["n"] += 1

            report = run_bench(subject, cfg, dev, dt, seqs=seqs, modes=modes, need_weights=need_weights,
                               baseline=baseline == "torch", min_time=min_time, progress=step)
            bar.update(task, completed=total)
    from tblock_cli import render

    if plot is not None:
        render.save_plot(report, plot)
        err.print(f"saved {plot}", highlight=False)
    if json_:
        print(render.dumps(render.bench_json(report)))
    else:
        out.print(render.bench_view(report))


def _check_plot_target(path: str) -> None:
    import importlib.util
    from pathlib import Path

    from tblock_cli.errors import ConfigError

    if Path(path).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path}: use a .png, .svg or .pdf file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'tblock[plot]'")
    if not Path(path).expanduser().resolve().parent.is_dir():
        raise ConfigError(f"--plot {path}: folder {Path(path).parent} does not exist")


@app.command()
def depth(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None,
    norm: Annotated[Optional[str], typer.Option("--norm", help="pre, post or mixed (alternating, starting with pre). (default: pre)", rich_help_panel=BLOCK, show_default=False)] = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None,
    layers: Annotated[int, typer.Option("--layers", help="Blocks in the stack.", rich_help_panel=BLOCK)] = 12,
    final_norm: Annotated[bool, typer.Option("--final-norm/--no-final-norm", help="A final LayerNorm after a Pre-LN last layer.", rich_help_panel=BLOCK)] = True,
    preset: Preset = None, batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None,
    seed: Seed = None, block: BlockSpec = None, kwargs: Kwargs = None,
    compare: Annotated[bool, typer.Option("--compare", help="Run pre, post and mixed stacks of the same depth side by side.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings (mixed placement, no final norm) fail: exit 1.")] = False,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Save per-layer charts to FILE.png or FILE.svg (needs matplotlib).", show_default=False)] = None,
    json_: Json = False,
):
    """A stack of N blocks at init: per-layer activation scale, gradient norms, residual gain and detected norm placement."""
    with user_errors():
        from tblock_cli.errors import ConfigError

        if compare and (block is not None or norm is not None):
            raise ConfigError("--compare runs the built-in pre, post and mixed stacks; drop --norm and --block")
        if plot is not None:
            _check_plot_target(plot)
        norms = ["pre", "post", "mixed"] if compare else [norm]
        flags = _flags(locals(), final_norm=final_norm)
        _warn_builtin_only(block, flags, layers_apply=True)
        configs = []
        for n in norms:
            cfg, dev, dt, _ = _setup(preset, None, None, allow_mixed=True, **_flags(flags, norm=n))
            configs.append(cfg)
        from tblock_cli import runtime
        from tblock_cli.depth import run_depth

        runtime.ensure_fits(runtime.estimate_bytes(configs[0]), dev, "depth")
        with err.status("measuring the stack", spinner="dots"):
            reports = [run_depth(c, dev, dt, spec=block, kwargs_json=kwargs, strict=strict) for c in configs]
    from tblock_cli import render

    if plot is not None:
        render.save_depth_plot(reports, plot)
        err.print(f"saved {plot}", highlight=False)
    ok = all(r.ok for r in reports)
    if json_:
        data = render.depth_json(reports[0]) if not compare else {"compare": [render.depth_json(r) for r in reports], "ok": ok}
        print(render.dumps(data))
    elif compare:
        out.print(render.depth_compare_view(reports))
    else:
        out.print(render.depth_view(reports[0]))
    raise typer.Exit(0 if ok else 1)


def _counting_subject(cfg, dt):
    """The built-in block on the meta device: shapes without storage, so counting gpt2-xl allocates nothing."""
    import torch

    from tblock_cli.loading import builtin_subject

    return builtin_subject(cfg, torch.device("meta"), dt)


def main():
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
