import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
# `--block tests/zoo.py:NAME` loads the file afresh for every block built: with PYTHONDONTWRITEBYTECODE set, each
# load compiled its 1,500 lines again (~50 ms, a quarter of a battery on a small block). The cached bytecode is
# checked against the source's mtime, so an edited zoo.py is still compiled anew.
sys.dont_write_bytecode = False
sys.path.insert(0, str(TESTS))  # so tests can `import zoo`

# One intra-op thread: on a shared 2-core machine two OpenMP threads fight for the cores and the suite
# runs 5-6x slower (measured 150-180 s against 27 s); nothing here measures speed.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/*.out from the current renderer")


@pytest.fixture(autouse=True)
def _seeded_one_thread():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


def zoo_spec(name: str) -> str:
    return f"{TESTS / 'zoo.py'}:{name}"
