"""The `tblock` command line: parse flags into options, call the Python API, render, exit with a code."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Annotated, Callable, Optional

import typer
import typer.core

from tblock_cli import __version__, flags
from tblock_cli.config import FLAGS, RUN
from tblock_cli.errors import OOM_HINT, ConfigError, LoadError, TBlockError, interrupted, on_interrupt
from tblock_cli.flags import RICH_HELP_MIN_WIDTH, SWITCH, Group, Json, NoArgsIsHelpError, Plot, click_errors, command
from tblock_cli.render.common import make_console
from tblock_cli.render.html import ensure_html_target, save_html
from tblock_cli.report import ensure_writable

app = typer.Typer(
    cls=Group,
    name="tblock",
    help="Diagnostics for Transformer blocks: is it correct (check), what does it compute (spec), how big is it (params), what does it cost (bench), how does it stack (depth)?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

out = make_console()
err = make_console(stderr=True)


def _version(value: bool):
    if value:
        print(f"tblock {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.", **SWITCH)] = False,
):
    """Diagnostics for Transformer blocks."""


def say(kind: str, message: str) -> None:
    """One line on stderr; the message is plain text (no markup or emoji codes: specs contain colons)."""
    from rich.text import Text

    err.print(Text.assemble((f"{kind}: ", "bold red" if kind == "error" else "yellow"), message), soft_wrap=True)


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout goes to stderr for a while, file descriptor 1 included (os.write, C
    extensions), so --json owns stdout; sys.stdout still writes to the real stdout after."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 (a closed stream): Python's own redirect is all there is
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def run_command(compute: Callable[[], object], render: Callable[[object], None], *, json_: bool,
                plot: str | None = None, save_plot: Callable[[object, str], None] | None = None,
                html: str | None = None) -> None:
    """The edge, for every command: compute, print warnings, render (JSON or tables), plot, HTML page, exit code.

    A TBlockError or running out of memory becomes one line on stderr and its exit code; a block's own
    prints go to stderr while --json owns stdout.
    """
    from tblock_cli.errors import is_out_of_memory

    try:
        if plot is not None:
            check_plot_target(plot)
        if html is not None:
            ensure_html_target(html)
        with stdout_to_stderr() if json_ else contextlib.nullcontext():
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
        if html is not None:
            save_html(report, html)
            err.print(f"saved {html}", highlight=False)
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

    if not os.path.isdir(path) and os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path}: use a .png, .svg or .pdf file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'tblock[plot]'")
    ensure_writable(path, "--plot")


def precheck(options: dict, *, allow_mixed: bool = False) -> None:
    """Every flag value that can be judged without torch, judged now (a bad --dtype answers in a blink)."""
    from tblock_cli.config import build_config, check_values, parse_kwargs, preset_values

    values = {k: v for k, v in options.items() if k in FLAGS}
    check_values(values, allow_mixed=allow_mixed)
    preset_values(options.get("preset"))
    if options.get("kwargs") is not None:
        if options.get("block") is None:
            raise LoadError("--kwargs only applies with --block SPEC")
        parse_kwargs(options["kwargs"])
    elif options.get("block") is None:
        build_config(options.get("preset"), allow_mixed=allow_mixed, **values)


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
    fast: Annotated[bool, typer.Option("--fast", help="Leave out the slow checks (kv_cache, dtype): for CI loops on big layers.", **SWITCH)] = False,
    like: flags.Like = None,
    like_kwargs: flags.LikeKwargs = None,
    expect: flags.Expect = None,
    json_: Json = False,
    html: flags.Html = None,
    **options,
):
    """Run the diagnostic battery on a block. Exit 0 when nothing fails, 1 when a check fails or errors, 2 on bad input."""
    block = options.pop("block")
    selection = {"only": only, "skip": skip, "fast": fast, "tp": tp, "fsdp": fsdp, "tp_plan": tp_plan,
                 "like": like, "like_kwargs": like_kwargs, "expect": expect}

    def compute():
        precheck({**options, "block": block})
        from tblock_cli.spec.declare import validate

        validate(like, like_kwargs, expect)
        if junit_xml is not None:
            ensure_writable(junit_xml, "--junit-xml")
        from tblock_cli import api

        if json_ or not err.is_terminal:  # a progress line only for a person watching a terminal
            report = api.check(block, strict=strict, **selection, **options)
        else:
            with err.status("checking", spinner="dots") as status:
                def progress(name: str, detail: str | None = None):
                    status.update(f"check: {name}" + (f" ({detail})" if detail else ""))

                report = api.check(block, strict=strict, progress=progress, **selection, **options)
        if junit_xml is not None:
            from tblock_cli.junit import write_junit

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
    like: flags.Like = None,
    like_kwargs: flags.LikeKwargs = None,
    expect: flags.Expect = None,
    json_: Json = False,
    html: flags.Html = None,
    **options,
):
    """What the block really computes, read black-box (the spec card: scale, soft-cap, rotary, activation, eps, residual,
    MoE routing, ...). With --like or --expect each declared entry is judged: exit 1 when one differs."""
    block = options.pop("block")

    def compute():
        precheck({**options, "block": block})
        from tblock_cli import api
        from tblock_cli.spec.declare import validate

        validate(like, like_kwargs, expect)
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
    html: flags.Html = None,
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
        precheck({**options, "block": block})
        if tree_depth is not None and tree_depth < 1:
            raise ConfigError(f"--tree-depth must be >= 1, got {tree_depth}")
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
    seq: Annotated[str, typer.Option("--seq", help="Sequence lengths to sweep, comma-separated.", rich_help_panel=RUN)] = "128,512",
    need_weights: Annotated[bool, typer.Option("--need-weights", help="Measure attention with need_weights (HF: output_attentions) forced on and off.", **SWITCH)] = False,
    mode: Annotated[str, typer.Option("--mode", help="infer (eval, inference_mode, forward), train (forward + backward) or both.")] = "both",
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
    html: flags.Html = None,
    **options,
):
    """Latency (median, IQR), peak memory and the attention kernel that ran; with --need-weights, both ways."""
    block = options.pop("block")

    def compute():
        from tblock_cli.benchmark.options import validate_bench

        precheck({**options, "block": block})
        validate_bench(seq, mode, baseline, min_time, decode)
        from tblock_cli.benchmark.saved import ensure_save_target, load_saved

        if save is not None:
            ensure_save_target(save)
        saved = load_saved(compare) if compare is not None else None  # read and validated before torch is imported
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from tblock_cli import api

        if tp is not None and plot is not None:
            raise ConfigError("--plot draws the sequence sweep; bench --tp has none")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("measuring", total=None)

            def step(desc: str, done: int, total: int):
                bar.update(task, completed=done, total=total, description=f"measuring {desc}")

            report = api.bench(block, seq=seq, need_weights=need_weights, mode=mode, baseline=baseline, min_time=min_time,
                               decode=decode, breakdown=breakdown, progress=step, compare_with=saved, tp=tp, tp_plan=tp_plan,
                               **options)
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
    html: flags.Html = None,
    **options,
):
    """A stack of N blocks at init: per-layer activation scale, gradient norms, residual gain and detected norm placement."""
    block = options.pop("block")

    def compute():
        precheck({**options, "block": block}, allow_mixed=True)
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
    html: flags.Html = None,
    **options,
):
    """Two implementations of one block with A's weights carried to B: outputs, gradients and decoding compared, the
    first differing part named. Exit 0 equal, 1 different, 2 bad input (an unmatched parameter among them)."""

    def compute():
        precheck({**options, "block": a})
        from tblock_cli.comparing import check_backend

        check_backend(backend, compile_)
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

