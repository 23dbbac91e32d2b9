"""Each shared flag declared once, on BlockConfig: the commands' options, the API and --compare derive from it."""

import typer.main

from tblock_cli.benchmark.saved import COMPARED_CONFIG
from tblock_cli.cli import app
from tblock_cli.config import BUILTIN_ONLY, FLAGS, SOURCE_FLAGS, TO_CONSTRUCTOR, Flag
from tblock_cli.subject.loading import ALIASES


def options_of(command: str) -> dict:
    cmd = typer.main.get_command(app).commands[command]
    return {p.name: p for p in cmd.params}


def test_every_command_takes_exactly_the_shared_flags_declared_for_it():
    for command in ("check", "params", "bench", "depth"):
        options = options_of(command)
        declared = {n for n, f in {**FLAGS, **SOURCE_FLAGS}.items() if command in f.commands}
        assert declared <= set(options), (command, declared - set(options))
        undeclared = {n for n, f in {**FLAGS, **SOURCE_FLAGS}.items() if command not in f.commands}
        assert not undeclared & set(options), command
        for name in declared - {"seq"} if command == "bench" else declared:  # bench's --seq is its own list
            flag = {**FLAGS, **SOURCE_FLAGS}[name]
            assert options[name].opts == [Flag.option(name)], name
            assert flag.help in options[name].help and options[name].default is None, name
            assert bool(options[name].secondary_opts) == flag.switch, name


def test_the_derived_lists_hold_what_they_did():
    assert BUILTIN_ONLY == ("norm", "activation", "eps", "bias", "layers", "final_norm")
    assert set(TO_CONSTRUCTOR) == set(ALIASES)
    assert set(COMPARED_CONFIG) == {"d_model", "n_heads", "d_ff", "dropout", "norm", "activation", "eps", "bias", "causal",
                                    "layers", "batch", "dtype", "block", "kwargs", "seq", "mode", "need_weights",
                                    "baseline", "decode"}
