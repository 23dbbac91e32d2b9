import sys
from pathlib import Path

import pytest
import typer.main
import typer.testing

TESTS = Path(__file__).parent
# `--block tests/zoo.py:NAME` loads the file afresh for every block built: with PYTHONDONTWRITEBYTECODE set, each
# load compiled the zoo again (~50 ms, a quarter of a battery on a small block). The cached bytecode is
# checked against the source's mtime, so an edited zoo.py is still compiled anew.
sys.dont_write_bytecode = False
sys.path.insert(0, str(TESTS))  # so tests can `import zoo`


def pytest_configure(config):
    # xdist's controller only hands out tests: importing torch there (~3 s) would hold back the workers' start.
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return
    import torch

    # One intra-op thread: on a shared 2-core machine two OpenMP threads fight for the cores and the suite
    # runs 5-6x slower (measured 150-180 s against 27 s); nothing here measures speed.
    torch.set_num_threads(1)
    _seeding_without_stacks(torch)


def _seeding_without_stacks(torch):
    """torch.manual_seed on a machine without the device still queues a lazy CUDA/XPU/MTIA seeding, and each queues
    traceback.format_stack() of its caller, for an error message that can only appear once the device initialises.
    At pytest's depth that is ~1 ms a call, three calls per seed, and a battery seeds ~27 times: ~10 % of the suite.
    The seed itself is still queued; only the text of the stack is left out, on devices that are absent."""
    import types

    for device in (torch.cuda, torch.xpu, torch.mtia):
        if not device.is_available():
            device.traceback = types.SimpleNamespace(format_stack=lambda: [])


# Typer builds the click command again on every CliRunner.invoke (~25 ms, 5 s over the suite); a command is
# reusable, as in one process running main() twice.
_commands: dict = {}


def _command_once(app):
    if id(app) not in _commands:
        _commands[id(app)] = (app, typer.main.get_command(app))  # the app kept alive: its id stays its own
    return _commands[id(app)][1]


typer.testing._get_command = _command_once


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.out from the current renderer")


@pytest.fixture(autouse=True)
def _seeded_one_thread():
    import torch

    # Without a GPU, the CPU generator alone: torch.manual_seed also queues a lazy CUDA/XPU/MTIA seeding that
    # formats the caller's stack each time (three stacks of pytest's depth, ~7 ms a test).
    if torch.cuda.is_available():
        torch.manual_seed(0)
    else:
        torch.default_generator.manual_seed(0)
    torch.set_num_threads(1)
    yield


def zoo_spec(name: str) -> str:
    return f"{TESTS / 'zoo.py'}:{name}"


@pytest.fixture
def torn_down_world():
    """A one-rank world a test made (a fairscale model's, through subject/caches.py) is taken down after: the rest of
    the suite runs in a process without one."""
    import torch.distributed as dist

    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        from fairscale.nn.model_parallel import initialize as fs_init

        fs_init.destroy_model_parallel()
        dist.destroy_process_group()
