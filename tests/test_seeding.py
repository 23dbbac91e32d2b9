"""The state_dict check's twin builds (checks/seeding.py): a construction that no torch seed reproduces is caught,
one that seeds its own streams passes (tests/zoo_construction.py)."""

import torch
from test_training_checks import run

from tblock_cli.checks import Status
from tblock_cli.checks.holdings import roots
from tblock_cli.checks.seeding import state_apart


def test_a_construction_that_no_torch_seed_reproduces_is_caught_and_one_that_seeds_its_own_streams_passes():
    """Built again at the run's seed with Python's and NumPy's streams seeded otherwise: weights from those streams
    differ (a warning: reproducible only where the script seeds them too); a reseed from the clock differs at one seed
    of every stream (a failure). Each names the tensors apart; a block whose generators it seeds itself passes."""
    numpy_init = run("NumpyInit", only=("state_dict",), spec_file="zoo_construction.py")["state_dict"]
    assert numpy_init.status is Status.WARN and numpy_init.kind == "state_dict.other_streams", numpy_init
    assert numpy_init.facts["built_apart"] == ["w1.weight", "w2.weight", "w3.weight"]
    python_init = run("PythonRandomInit", only=("state_dict",), spec_file="zoo_construction.py")["state_dict"]
    assert python_init.kind == "state_dict.other_streams" and python_init.facts["built_apart"] == ["k_proj.weight", "q_proj.weight"]
    clock = run("ClockSeededInit", only=("state_dict",), spec_file="zoo_construction.py")["state_dict"]
    assert clock.status is Status.FAIL and clock.kind == "state_dict.unseeded", clock
    assert set(clock.facts["built_apart"]) >= {"q_proj.weight", "w2.weight"}
    ok = run("OwnGeneratorInit", only=("state_dict",), spec_file="zoo_construction.py")["state_dict"]
    assert ok.kind == "state_dict.round_trip" and ok.facts["built_apart"] is None, ok


def test_two_modules_are_apart_where_a_tensor_differs_by_a_bit_or_is_held_by_one_only():
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert state_apart(a, b) == [] and roots(a) == [a]
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(1.0))  # one unit in the last place
        a.weight[0, 0] = b.weight[0, 0] = float("nan")  # memory left unwritten may hold NaN: equal to itself here
    assert state_apart(a, b) == ["bias"]
    b.register_buffer("count", torch.zeros(()))
    assert state_apart(a, b) == ["bias", "count"]
