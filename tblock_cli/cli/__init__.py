"""The `tblock` command line: parse flags into options, call the Python API, render, exit with a code."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
import typer.core

from tblock_cli import __version__
from tblock_cli.cli.edge import err, out, run_command, say
from tblock_cli.cli.flags import (
    RICH_HELP_MIN_WIDTH,
    SWITCH,
    Expect,
    Group,
    Html,
    Json,
    Like,
    LikeKwargs,
    NoArgsIsHelpError,
    Plot,
    click_errors,
    command,
)
from tblock_cli.config import RUN
from tblock_cli.errors import ConfigError, interrupted, on_interrupt

app = typer.Typer(
    cls=Group,
    name="tblock",
    help="Diagnostics for Transformer blocks: is it correct (check), what does it compute (spec), how big is it (params), what does it cost (bench), how does it stack (depth)?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)



def _version(value: bool):
    if value:
        print(f"tblock {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.", **SWITCH)] = False,
):
    """Diagnostics for Transformer blocks."""


@command(app)
def check(
    *,
    strict: Annotated[bool, typer.Option("--strict", help="Treat warnings as failures.", **SWITCH)] = False,
    junit_xml: Annotated[Optional[str], typer.Option("--junit-xml", help="Also write the results as JUnit XML to FILE, for CI.", show_default=False, metavar="FILE")] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Also check the block tensor-parallel over N local ranks (gloo on CPU, NCCL on GPUs; under torchrun, its world).", show_default=False, metavar="N")] = None,
    fsdp: Annotated[Optional[int], typer.Option("--fsdp", help="Also check the block under FSDP2 (fully_shard) over N ranks, each its own micro-batch.", show_default=False, metavar="N")] = None,
    tp_plan: Annotated[Optional[str], typer.Option("--tp-plan", help="The --tp plan as JSON: module name -> colwise, rowwise or replicate. (default: derived from the dataflow)", show_default=False, metavar="FILE")] = None,
    only: Annotated[Optional[str], typer.Option("--only", help="Run only these checks (comma-separated names).", show_default=False, metavar="NAMES")] = None,
    skip: Annotated[Optional[str], typer.Option("--skip", help="Leave out these checks (comma-separated names).", show_default=False, metavar="NAMES")] = None,
    fast: Annotated[bool, typer.Option("--fast", help="Leave out the slow checks (kv_cache, dtype, dropout and the training-time checks): for CI loops on big layers.", **SWITCH)] = False,
    like: Like = None,
    like_kwargs: LikeKwargs = None,
    expect: Expect = None,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """Run the diagnostic battery on a block. Exit 0 when nothing fails, 1 when a check fails or errors, 2 on bad input."""
    block = options.pop("block")
    selection = {"only": only, "skip": skip, "fast": fast, "tp": tp, "fsdp": fsdp, "tp_plan": tp_plan,
                 "like": like, "like_kwargs": like_kwargs, "expect": expect}

    def compute():
        if junit_xml is not None:
            from tblock_cli.render.junit import ensure_junit_target

            ensure_junit_target(junit_xml)
        from tblock_cli import api

        if json_ or not err.is_terminal:  # a progress line only for a person watching a terminal
            report = api.check(block, strict=strict, **selection, **options)
        else:
            with err.status("checking", spinner="dots") as status:
                def progress(name: str, detail: str | None = None):
                    status.update(f"check: {name}" + (f" ({detail})" if detail else ""))

                report = api.check(block, strict=strict, progress=progress, **selection, **options)
        if junit_xml is not None:
            from tblock_cli.render.junit import write_junit

            write_junit(report, junit_xml)
        return report

    def show(report):
        from tblock_cli import render

        out.print(render.check_view(report))

    from tblock_cli.distributed.ranks import quiet_unless_rank_zero

    with quiet_unless_rank_zero():
        run_command(compute, show, json_=json_, html=html)


@command(app)
def spec(
    *,
    like: Like = None,
    like_kwargs: LikeKwargs = None,
    expect: Expect = None,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """What the block really computes, read black-box (the spec card: scale, soft-cap, rotary, activation, eps, residual,
    MoE routing, ...). With --like or --expect each declared entry is judged: exit 1 when one differs."""
    block = options.pop("block")

    def compute():
        from tblock_cli import api

        with err.status("reading the spec", spinner="dots") as status:
            return api.spec(block, like=like, like_kwargs=like_kwargs, expect=expect,
                            progress=lambda what: status.update(f"spec: {what}"), **options)

    def show(report):
        from tblock_cli.render.spec import spec_view

        out.print(spec_view(report))

    run_command(compute, show, json_=json_, html=html)


@command(app)
def params(
    *,
    tree_depth: Annotated[Optional[int], typer.Option("--tree-depth", help="Rows from the module tree, this deep, instead of dataflow roles.", show_default=False)] = None,
    list_presets: Annotated[bool, typer.Option("--list-presets", help="List the --preset shapes and exit.", **SWITCH)] = False,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """Parameters, bytes and FLOPs per component (norms, attention q/k/v/out, FFN), the FFN's share and the KV cache."""
    if list_presets:
        from tblock_cli.config import PRESETS

        if json_:
            from tblock_cli.report import dumps, envelope

            print(dumps(envelope("params", True, "presets", {}, {}, {"presets": PRESETS})))
        else:
            from tblock_cli import render

            out.print(render.presets_view(PRESETS))
        raise typer.Exit(0)
    block = options.pop("block")

    def compute():
        from tblock_cli import api

        with err.status("counting", spinner="dots"):
            return api.params(block, tree_depth=tree_depth, **options)

    def show(report):
        from tblock_cli import render

        out.print(render.params_view(report))

    run_command(compute, show, json_=json_, html=html)


@command(app)
def bench(
    *,
    seq: Annotated[Optional[str], typer.Option("--seq", help="Sequence lengths to sweep, comma-separated. (default: 128,512; with --tp: 128)", rich_help_panel=RUN, show_default=False)] = None,
    need_weights: Annotated[bool, typer.Option("--need-weights", help="Measure attention with need_weights (HF: output_attentions) forced on and off.", **SWITCH)] = False,
    mode: Annotated[Optional[str], typer.Option("--mode", help="infer (eval, inference_mode, forward), train (forward + backward) or both. (default: both; with --tp: train)", show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="torch: also time nn.TransformerEncoderLayer of the same shape, and print the ratio.", show_default=False)] = None,
    min_time: Annotated[float, typer.Option("--min-time", help="Seconds of timed calls per measurement, in (0, 600].")] = 0.5,
    decode: Annotated[Optional[int], typer.Option("--decode", help="Generate N tokens after a --seq prompt, with the KV cache and by recomputing the prefix.", show_default=False)] = None,
    breakdown: Annotated[bool, typer.Option("--breakdown", help="Time and peak memory per component (projections, attention kernel, FFN, norms, residual adds).", **SWITCH)] = False,
    save: Annotated[Optional[str], typer.Option("--save", help="Write this run's JSON to FILE, to --compare against later.", show_default=False)] = None,
    compare: Annotated[Optional[str], typer.Option("--compare", help="Compare with a run saved by --save: exit 1 if slower beyond the noise or >1% more memory.", show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Instead: the block tensor-parallel over N local ranks, per-rank latency (forward + backward at the first --seq) and the share in collectives.", show_default=False, metavar="N")] = None,
    tp_plan: Annotated[Optional[str], typer.Option("--tp-plan", help="The --tp plan as JSON: module name -> colwise, rowwise or replicate. (default: derived from the dataflow)", show_default=False, metavar="FILE")] = None,
    plot: Plot = None,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """Latency (median, IQR), peak memory and the attention kernel that ran; with --need-weights, both ways."""
    block = options.pop("block")

    def compute():
        from tblock_cli.benchmark.saved import ensure_save_target, load_saved

        if save is not None:
            ensure_save_target(save)
        saved = load_saved(compare) if compare is not None else None  # read and validated before torch is imported
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from tblock_cli import api

        if tp is not None and plot is not None:
            raise ConfigError("--plot draws the sequence sweep; bench --tp has none")
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=err, transient=True)
        task = None

        def step(desc: str, done: int, total: int):  # the bar starts with the first measurement: a refused flag shows none
            nonlocal task
            if task is None:
                bar.start()
                task = bar.add_task("measuring", total=None)
            bar.update(task, completed=done, total=total, description=f"measuring {desc}")

        try:
            report = api.bench(block, seq=seq, need_weights=need_weights, mode=mode, baseline=baseline, min_time=min_time,
                               decode=decode, breakdown=breakdown, progress=step, compare_with=saved, tp=tp, tp_plan=tp_plan,
                               **options)
        finally:
            if task is not None:
                bar.stop()
        if save is not None:
            api.save_report(report, save)
        return report

    def show(report):
        from tblock_cli import render

        out.print(render.tp_bench_view(report) if tp is not None else render.bench_view(report))

    def save_plot(report, path):
        from tblock_cli import render

        render.save_plot(report, path)

    run_command(compute, show, json_=json_, plot=plot, save_plot=save_plot, html=html)


@command(app)
def depth(
    *,
    compare: Annotated[bool, typer.Option("--compare", help="Run pre, post and mixed stacks of the same depth side by side.", **SWITCH)] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings (mixed placement, no final norm) fail: exit 1.", **SWITCH)] = False,
    plot: Plot = None,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """A stack of N blocks at init: per-layer activation scale, gradient norms, residual gain and detected norm placement."""
    block = options.pop("block")

    def compute():
        from tblock_cli import api

        with err.status("measuring the stack", spinner="dots"):
            return api.depth(block, compare=compare, strict=strict, **options)

    def show(report):
        from tblock_cli import render

        out.print(render.depth_compare_view(report.reports) if compare else render.depth_view(report))

    def save_plot(report, path):
        from tblock_cli import render

        render.save_depth_plot(report.reports if compare else [report], path)

    run_command(compute, show, json_=json_, plot=plot, save_plot=save_plot, html=html)


@command(app)
def compare(
    a: Annotated[str, typer.Argument(help="Block A: path/to/file.py:NAME, package.module:NAME, hf:TYPE or builtin.", show_default=False)],
    b: Annotated[Optional[str], typer.Argument(help="Block B, the same kinds; A's weights are carried to it. Omit with --compile.", show_default=False)] = None,
    *,
    dropout: Annotated[Optional[float], typer.Option("--dropout", help="Dropout probability of both sides; above 0, gradients are compared in eval mode. (default: 0)", rich_help_panel="Block (shared by every command)", show_default=False, metavar="FLOAT")] = None,
    kwargs_a: Annotated[Optional[str], typer.Option("--kwargs-a", help="More constructor (or hf config) keywords for A, as a JSON object.", show_default=False, metavar="JSON")] = None,
    kwargs_b: Annotated[Optional[str], typer.Option("--kwargs-b", help="More constructor (or hf config) keywords for B, as a JSON object.", show_default=False, metavar="JSON")] = None,
    dtype_b: Annotated[Optional[str], typer.Option("--dtype-b", help="B's dtype (A keeps --dtype): the error per component shows where precision is lost.", rich_help_panel=RUN, show_default=False, metavar="TEXT")] = None,
    compile_: Annotated[bool, typer.Option("--compile", help="Compare A with torch.compile(A): outputs, gradients, graph breaks with reasons, recompiles.", **SWITCH)] = False,
    backend: Annotated[Optional[str], typer.Option("--backend", help="torch.compile's backend with --compile: inductor, aot_eager or eager; stepping down says whether a difference is inductor's, autograd tracing's or dynamo's. (default: inductor where it can build kernels, else aot_eager)", show_default=False, metavar="TEXT")] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="Absolute tolerance (with --rtol: torch.allclose's rule). (default: the dtype's relative tolerance)", show_default=False, metavar="FLOAT")] = None,
    rtol: Annotated[Optional[float], typer.Option("--rtol", help="Relative tolerance, elementwise.", show_default=False, metavar="FLOAT")] = None,
    map_file: Annotated[Optional[str], typer.Option("--map", help="JSON object, A parameter name -> B parameter name, overriding the matching.", show_default=False, metavar="FILE")] = None,
    json_: Json = False,
    html: Html = None,
    **options,
):
    """Two implementations of one block with A's weights carried to B: outputs, gradients and decoding compared, the
    first differing part named. Exit 0 equal, 1 different, 2 bad input (an unmatched parameter among them)."""

    def compute():
        if b is None and not compile_:
            raise ConfigError("compare needs two blocks (A B; builtin names the built-in block), or --compile")
        from tblock_cli import api

        with err.status("comparing", spinner="dots"):
            return api.compare(a, b, kwargs_a=kwargs_a, kwargs_b=kwargs_b, dtype_b=dtype_b, compile=compile_,
                               backend=backend, atol=atol, rtol=rtol, map_file=map_file, dropout=dropout, **options)

    def show(report):
        from tblock_cli.render.compare import compare_view

        out.print(compare_view(report))

    run_command(compute, show, json_=json_, html=html)


def main(args: list[str] | None = None):
    if out.width < RICH_HELP_MIN_WIDTH:
        app.rich_markup_mode = None  # Click's plain help wraps every column; Rich's tables would cut flag names
    on_interrupt()
    try:
        code = app(args=args, standalone_mode=False)
    except NoArgsIsHelpError as e:
        e.show()
        code = e.exit_code
    except click_errors.UsageError as e:  # a flag Typer cannot parse: one line, not a box
        where = e.ctx.command_path if e.ctx is not None else "tblock"
        say("error", f"{e.format_message()} (see {where} --help)")
        code = e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        interrupted()
    raise SystemExit(code if isinstance(code, int) else 0)

