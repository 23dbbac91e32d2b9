"""The `tblock` command line: parse flags into options, call the Python API, render, exit with a code."""

from __future__ import annotations

import contextlib
import sys
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from tblock_cli import __version__
from tblock_cli.errors import OOM_HINT, ConfigError, TBlockError
from tblock_cli.report import ensure_writable

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
Eps = Annotated[Optional[float], typer.Option("--eps", help="LayerNorm eps, in [0, 1); 0 is allowed but warned (NaN on a constant token). (default: 1e-05)", rich_help_panel=BLOCK, show_default=False)]
Bias = Annotated[Optional[bool], typer.Option("--bias/--no-bias", help="Biases in Linear and LayerNorm layers. (default: --bias)", rich_help_panel=BLOCK, show_default=False)]
Causal = Annotated[Optional[bool], typer.Option("--causal/--no-causal", help="Causal attention mask (and the causal checks). (default: --no-causal)", rich_help_panel=BLOCK, show_default=False)]
Layers = Annotated[Optional[int], typer.Option("--layers", help="Blocks in the stack; a Pre-LN stack gets a final LayerNorm. (default: the preset's, else 1)", rich_help_panel=BLOCK, show_default=False)]
Preset = Annotated[Optional[str], typer.Option("--preset", help="A well-known shape (see `tblock params --list-presets`); explicit flags override it.", rich_help_panel=BLOCK, show_default=False)]
Positional = Annotated[Optional[bool], typer.Option("--positional/--no-positional", help="The block has positions inside (RoPE, ALiBi, relative bias): token order matters, the order check skips.", rich_help_panel=BLOCK, show_default=False)]
PadKeyword = Annotated[Optional[str], typer.Option("--pad-keyword", help="Your forward's keyword for the padding mask, e.g. mask or attention_mask. (default: detect pad_mask, key_padding_mask, ...)", rich_help_panel=BLOCK, show_default=False)]
PadMeans = Annotated[Optional[str], typer.Option("--pad-means", help="What True means in your block's mask: pad (PyTorch) or keep (HF, x-transformers). (default: pad)", rich_help_panel=BLOCK, show_default=False)]
Batch = Annotated[Optional[int], typer.Option("--batch", help="Samples per input. (default: 2)", rich_help_panel=RUN, show_default=False)]
Seq = Annotated[Optional[int], typer.Option("--seq", help="Tokens per sample. (default: 10)", rich_help_panel=RUN, show_default=False)]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="float32, float16 or bfloat16. (default: float32)", rich_help_panel=RUN, show_default=False)]
Device = Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps; auto = cuda when present. (default: auto)", rich_help_panel=RUN, show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seeds weights and inputs. (default: 0)", rich_help_panel=RUN, show_default=False)]
Threads = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads for the run. (default: torch's)", rich_help_panel=RUN, show_default=False)]
BlockSpec = Annotated[Optional[str], typer.Option("--block", help="Your own block: package.module:NAME or path/to/file.py:NAME (a class or a factory).", rich_help_panel=BLOCK, show_default=False)]
Kwargs = Annotated[Optional[str], typer.Option("--kwargs", help="More constructor keywords for --block, as a JSON object.", rich_help_panel=BLOCK, show_default=False)]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (see docs/json.md) instead of tables.")]
Plot = Annotated[Optional[str], typer.Option("--plot", help="Save a chart to FILE.png, .svg or .pdf (needs pip install 'tblock\\[plot]').", show_default=False)]

out = Console()
err = Console(stderr=True)

# The shared option names, as the API takes them.
OPTIONS = ("d_model", "n_heads", "d_ff", "dropout", "norm", "activation", "eps", "bias", "causal", "layers", "batch",
           "seq", "dtype", "device", "seed", "threads", "positional", "pad_keyword", "pad_means", "preset", "kwargs")


def _options(values: dict, **override) -> dict:
    """The shared options out of a command's arguments (its locals()), with overrides."""
    return {**{k: values[k] for k in OPTIONS if k in values}, **override}


def _version(value: bool):
    if value:
        print(f"tblock {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
):
    """Diagnostics for Transformer blocks."""


def say(kind: str, message: str) -> None:
    """One line on stderr; the message is plain text (no markup or emoji codes: specs contain colons)."""
    from rich.text import Text

    err.print(Text.assemble((f"{kind}: ", "bold red" if kind == "error" else "yellow"), message), soft_wrap=True)


def run_command(compute: Callable[[], object], render: Callable[[object], None], *, json_: bool,
                plot: str | None = None, save_plot: Callable[[object, str], None] | None = None) -> None:
    """The edge, for every command: compute, print warnings, render (JSON or tables), plot, exit code.

    A TBlockError or running out of memory becomes one line on stderr and its exit code; a block's own
    prints go to stderr while --json owns stdout.
    """
    from tblock_cli.errors import is_out_of_memory

    try:
        if plot is not None:
            check_plot_target(plot)
        with contextlib.redirect_stdout(sys.stderr) if json_ else contextlib.nullcontext():
            report = compute()
        for w in report.run.warnings if report.run else ():
            say("warning", w)
        if json_:
            from tblock_cli.report import dumps

            print(dumps(report.to_dict()))
        else:
            render(report)
        if plot is not None:
            try:
                save_plot(report, plot)
            except OSError as e:
                raise ConfigError(f"--plot {plot}: cannot write it: {e.strerror or e}") from None
            err.print(f"saved {plot}", highlight=False)
    except TBlockError as e:
        say("error", str(e))
        raise typer.Exit(e.exit_code) from None
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        say("error", f"out of memory; {OOM_HINT}")
        raise typer.Exit(2) from None
    raise typer.Exit(0 if report.ok else 1)


def check_plot_target(path: str) -> None:
    """Refuse, before measuring, a plot that could not be written: wrong suffix, no matplotlib, no such folder."""
    import importlib.util
    import os

    if not os.path.isdir(path) and os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path}: use a .png, .svg or .pdf file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'tblock[plot]'")
    ensure_writable(path, "--plot")


@app.command()
def check(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None, positional: Positional = None, pad_keyword: PadKeyword = None, pad_means: PadMeans = None,
    batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None, seed: Seed = None,
    threads: Threads = None, block: BlockSpec = None, kwargs: Kwargs = None,
    strict: Annotated[bool, typer.Option("--strict", help="Treat warnings as failures.")] = False,
    only: Annotated[Optional[str], typer.Option("--only", help="Run only these checks (comma-separated names).", show_default=False)] = None,
    skip: Annotated[Optional[str], typer.Option("--skip", help="Leave out these checks (comma-separated names).", show_default=False)] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Leave out the slow checks (kv_cache, dtype): for CI loops on big layers.")] = False,
    json_: Json = False,
):
    """Run the diagnostic battery on a block. Exit 0 when nothing fails, 1 when a check fails or errors, 2 on bad input."""
    options = _options(locals())
    selection = {"only": only, "skip": skip, "fast": fast}

    def compute():
        from tblock_cli import api

        if json_ or not err.is_terminal:  # a progress line only for a person watching a terminal
            return api.check(block, strict=strict, **selection, **options)
        with err.status("checking", spinner="dots") as status:
            def progress(name: str, detail: str | None = None):
                status.update(f"check: {name}" + (f" ({detail})" if detail else ""))

            return api.check(block, strict=strict, progress=progress, **selection, **options)

    def show(report):
        from tblock_cli import render

        out.print(render.check_view(report))

    run_command(compute, show, json_=json_)


@app.command()
def params(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None, positional: Positional = None, pad_keyword: PadKeyword = None, pad_means: PadMeans = None,
    batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None, seed: Seed = None,
    threads: Threads = None, block: BlockSpec = None, kwargs: Kwargs = None,
    tree_depth: Annotated[Optional[int], typer.Option("--tree-depth", help="Rows from the module tree, this deep, instead of dataflow roles.", show_default=False)] = None,
    list_presets: Annotated[bool, typer.Option("--list-presets", help="List the --preset shapes and exit.")] = False,
    json_: Json = False,
):
    """Parameters, bytes and FLOPs per component (norms, attention q/k/v/out, FFN), the FFN's share and the KV cache."""
    if list_presets:
        from tblock_cli.config import PRESETS

        if json_:
            import json

            print(json.dumps(PRESETS, indent=2))
        else:
            from tblock_cli import render

            out.print(render.presets_view(PRESETS))
        raise typer.Exit(0)
    options = _options(locals())

    def compute():
        from tblock_cli import api

        with err.status("counting", spinner="dots"):
            return api.params(block, tree_depth=tree_depth, **options)

    def show(report):
        from tblock_cli import render

        out.print(render.params_view(report))

    run_command(compute, show, json_=json_)


@app.command()
def bench(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None, norm: Norm = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    preset: Preset = None, positional: Positional = None, pad_keyword: PadKeyword = None, pad_means: PadMeans = None,
    batch: Batch = None,
    seq: Annotated[str, typer.Option("--seq", help="Sequence lengths to sweep, comma-separated.", rich_help_panel=RUN)] = "128,512",
    dtype: Dtype = None, device: Device = None, seed: Seed = None, threads: Threads = None,
    block: BlockSpec = None, kwargs: Kwargs = None,
    need_weights: Annotated[bool, typer.Option("--need-weights", help="Measure attention with need_weights (HF: output_attentions) forced on and off.")] = False,
    mode: Annotated[str, typer.Option("--mode", help="infer (eval, inference_mode, forward), train (forward + backward) or both.")] = "both",
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="torch: also time nn.TransformerEncoderLayer of the same shape, and print the ratio.", show_default=False)] = None,
    min_time: Annotated[float, typer.Option("--min-time", help="Seconds of timed calls per measurement, in (0, 600].")] = 0.5,
    decode: Annotated[Optional[int], typer.Option("--decode", help="Generate N tokens after a --seq prompt, with the KV cache and by recomputing the prefix.", show_default=False)] = None,
    breakdown: Annotated[bool, typer.Option("--breakdown", help="Time and peak memory per component (projections, attention kernel, FFN, norms, residual adds).")] = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write this run's JSON to FILE, to --compare against later.", show_default=False)] = None,
    compare: Annotated[Optional[str], typer.Option("--compare", help="Compare with a run saved by --save: exit 1 if slower beyond the noise or >1% more memory.", show_default=False)] = None,
    plot: Plot = None,
    json_: Json = False,
):
    """Latency (median, IQR), peak memory and the attention kernel that ran; with --need-weights, both ways."""
    options = _options(locals())
    options.pop("seq")

    def compute():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from tblock_cli import api

        saved = api.load_saved(compare) if compare else None
        if save is not None:
            ensure_writable(save, "--save")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("measuring", total=None)

            def step(desc: str, done: int, total: int):
                bar.update(task, completed=done, total=total, description=f"measuring {desc}")

            report = api.bench(block, seq=seq, need_weights=need_weights, mode=mode, baseline=baseline, min_time=min_time,
                               decode=decode, breakdown=breakdown, progress=step, compare_with=saved, **options)
        if save is not None:
            api.save_report(report, save)
        return report

    def show(report):
        from tblock_cli import render

        out.print(render.bench_view(report))

    def save_plot(report, path):
        from tblock_cli import render

        render.save_plot(report, path)

    run_command(compute, show, json_=json_, plot=plot, save_plot=save_plot)


@app.command()
def depth(
    d_model: DModel = None, n_heads: NHeads = None, d_ff: DFF = None, dropout: Dropout = None,
    norm: Annotated[Optional[str], typer.Option("--norm", help="pre, post or mixed (alternating, starting with pre). (default: pre)", rich_help_panel=BLOCK, show_default=False)] = None,
    activation: Activation = None, eps: Eps = None, bias: Bias = None, causal: Causal = None, layers: Layers = None,
    final_norm: Annotated[bool, typer.Option("--final-norm/--no-final-norm", help="A final LayerNorm after a Pre-LN last layer.", rich_help_panel=BLOCK)] = True,
    preset: Preset = None, batch: Batch = None, seq: Seq = None, dtype: Dtype = None, device: Device = None,
    seed: Seed = None, threads: Threads = None, block: BlockSpec = None, kwargs: Kwargs = None,
    compare: Annotated[bool, typer.Option("--compare", help="Run pre, post and mixed stacks of the same depth side by side.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings (mixed placement, no final norm) fail: exit 1.")] = False,
    plot: Plot = None,
    json_: Json = False,
):
    """A stack of N blocks at init: per-layer activation scale, gradient norms, residual gain and detected norm placement."""
    options = _options(locals())

    def compute():
        from tblock_cli import api

        with err.status("measuring the stack", spinner="dots"):
            return api.depth(block, compare=compare, strict=strict, final_norm=final_norm, **options)

    def show(report):
        from tblock_cli import render

        out.print(render.depth_compare_view(report.reports) if compare else render.depth_view(report))

    def save_plot(report, path):
        from tblock_cli import render

        render.save_depth_plot(report.reports if compare else [report], path)

    run_command(compute, show, json_=json_, plot=plot, save_plot=save_plot)


def main():
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        raise SystemExit(130) from None
