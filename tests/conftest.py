import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # so tests can `import zoo`


@pytest.fixture(autouse=True)
def _small_threads():
    torch.manual_seed(0)
    yield


def zoo_spec(name: str) -> str:
    return f"{TESTS / 'zoo.py'}:{name}"
