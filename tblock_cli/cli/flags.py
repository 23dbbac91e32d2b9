"""The shared flags as Typer options: built from the flags declared on BlockConfig, so each is declared once."""

from __future__ import annotations

import inspect
from typing import Annotated, Callable, Optional

import typer
import typer.core

from tblock_cli.config import FLAGS, SOURCE_FLAGS, Flag

try:  # typer 0.24 and later carry their own copy of Click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_errors
# Click 8.2 raises this for a bare `tblock` (it shows the help); older Click exits with the help itself.
NoArgsIsHelpError = getattr(click_errors, "NoArgsIsHelpError", ())


class _HelpSwitch:
    """-h/--help is a switch: no "<bool>" beside it."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Command(_HelpSwitch, typer.core.TyperCommand):
    pass


class Group(_HelpSwitch, typer.core.TyperGroup):
    pass


# Below this many columns the boxed help has no room for a flag name beside its help: it cuts both.
RICH_HELP_MIN_WIDTH = 80
# Switches show no type: "--strict <bool>" reads as if it took a value.
SWITCH = {"metavar": ""}
METAVARS = {int: "N", float: "FLOAT", str: "TEXT"}
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (see docs/json.md) instead of tables.", **SWITCH)]
Like = Annotated[Optional[str], typer.Option("--like", help="What the block claims to be: hf:TYPE, a Hugging Face layer built at the same sizes; its spec card is read the same way and each entry judged.", show_default=False, metavar="hf:TYPE", rich_help_panel="Declared spec")]
LikeKwargs = Annotated[Optional[str], typer.Option("--like-kwargs", help="The --like layer's config overrides, as a JSON object (e.g. '{\"rope_theta\": 500000}').", show_default=False, metavar="JSON", rich_help_panel="Declared spec")]
Expect = Annotated[Optional[list[str]], typer.Option("--expect", help="A card entry the block must have, KEY=VALUE (repeatable; keys as `tblock spec` prints them, e.g. rope.theta=500000, ffn.act=gelu_tanh, attn.softcap=50).", show_default=False, metavar="KEY=VALUE", rich_help_panel="Declared spec")]
Html = Annotated[Optional[str], typer.Option("--html", help="Also write the report as one self-contained HTML page (tables, SVG figures; no scripts) to FILE.", show_default=False, metavar="FILE")]
Plot = Annotated[Optional[str], typer.Option("--plot", help="Save a chart to FILE.png, .svg or .pdf (needs pip install 'tblock\\[plot]').", show_default=False, metavar="FILE")]


def shared_parameter(name: str, flag: Flag) -> inspect.Parameter:
    """A shared flag as a Typer option. None means "not given", so a --preset's value stands unless a flag overrides it."""
    from tblock_cli.config import DEFAULTS

    shown = flag.default_text if flag.default_text is not None else DEFAULTS.get(name)
    text = flag.help + (f" (default: {shown})" if shown not in (None, "") else "")
    option = Flag.option(name)
    decl = f"{option}/--no-{option[2:]}" if flag.switch else option
    extra = SWITCH if flag.switch else {"metavar": METAVARS[flag.type]}
    info = typer.Option(decl, help=text, rich_help_panel=flag.panel, show_default=False, **extra)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[flag.type], info])


def command(app: typer.Typer) -> Callable[[Callable], Callable]:
    """Register `body` as a command whose options are its own parameters plus every shared flag it takes.

    Typer reads a command's options from its signature, so the command gets one built from the flags
    declared on BlockConfig; the body receives the shared ones as keyword arguments.
    """
    def register(body: Callable) -> Callable:
        _register(app, body)
        return body
    return register


def _register(app: typer.Typer, body: Callable) -> None:
    name = body.__name__
    own = [p for p in inspect.signature(body, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in own}
    shared = [shared_parameter(n, f) for n, f in {**FLAGS, **SOURCE_FLAGS}.items() if name in f.commands and n not in taken]

    def run(**values):
        return body(**values)

    run.__name__, run.__doc__ = name, body.__doc__
    positional = [p for p in own if p.kind is not p.KEYWORD_ONLY]  # arguments (compare's A and B) come first
    run.__signature__ = inspect.Signature(positional + shared + [p for p in own if p.kind is p.KEYWORD_ONLY])
    app.command(name, cls=Command)(run)


