"""The `device` check: blocks that would raise on a GPU caught on the CPU, each naming the operation; the correct
twins (tensors made on the input's device, buffers, lazy moves, host scalars and indices) left clean; CUDA's device
rule as the check applies it, op by op."""

import pytest
import torch
import torch.nn as nn
import zoo_device

import tblock_cli
from tblock_cli.checks import Status, run_checks
from tblock_cli.checks.device import DEVICE, DeviceMismatch, HostFactories, Sides, device_sides
from tblock_cli.config import build_config
from tblock_cli.runtime import dispatch_mode
from tblock_cli.subject.loading import make_subject

from conftest import TESTS


def device_check(name):
    spec = f"{TESTS / 'zoo_device.py'}:{name}" if name else None
    return tblock_cli.check(spec, d_model=32, n_heads=4, causal=True, threads=1, only="device").checks[0]


@pytest.mark.parametrize("name", zoo_device.PLANTED)
def test_a_tensor_left_on_the_host_is_caught(name):
    c = device_check(name)
    assert c.status is Status.WARN and c.kind == "device.mismatch", c


@pytest.mark.parametrize("name", [None, *zoo_device.CORRECT])
def test_tensors_made_or_moved_where_the_block_is_pass(name):
    c = device_check(name)
    assert c.status is Status.PASS and c.kind == "device.portable", c


def test_the_mismatch_names_the_operation_and_the_host_tensor():
    c = device_check("MaskFromHostArange")
    assert c.facts == {"op": "masked_fill", "host_shapes": [[10, 10]]}
    assert "masked_fill" in c.detail and "(10, 10)" in c.detail


def _run(f, *tensors):
    """f(*tensors) under the check's rule, the tensors on the device's side."""
    sides = Sides()
    for t in tensors:
        sides.side[t] = DEVICE
    with HostFactories(sides), dispatch_mode(sides.on_op):
        return f(*tensors)


@pytest.mark.parametrize("f", [
    lambda x: x + torch.ones(4),  # a host tensor in arithmetic
    lambda x: x * torch.tensor([2.0]),  # one element, one dimension: not a scalar to CUDA
    lambda x: x.index_select(1, torch.arange(2)),  # index_select's index must be on the device
    lambda x: torch.nn.functional.embedding(torch.arange(2), x[0]),
    lambda x: torch.where(torch.ones(3, 4, dtype=torch.bool), x, 0.0),
    lambda x: x @ torch.ones(4, 4).to(torch.float64).float(),  # .to(dtype) moves nothing
])
def test_what_cuda_refuses_is_a_mismatch(f):
    with pytest.raises(DeviceMismatch):
        _run(f, torch.randn(3, 4))


@pytest.mark.parametrize("f", [
    lambda x: x * torch.tensor(2.0),  # a 0-dim host tensor: a scalar anywhere
    lambda x: x[:, torch.arange(2)],  # host indices of an indexing
    lambda x: x + torch.ones(4, device=x.device),
    lambda x: x + torch.ones(4).to(x.device),
    lambda x: x + torch.ones(4).to(x),
    lambda x: x + torch.ones(4).type_as(x),
    lambda x: x + x.new_ones(4) + torch.zeros_like(x),
    lambda x: torch.ones(3, 4).copy_(x),  # a copy between devices
])
def test_what_cuda_takes_runs(f):
    _run(f, torch.randn(3, 4))


def test_a_host_tensor_whose_device_is_read_is_not_judged():
    host = torch.ones(4)

    def f(x):
        h = host if host.device == x.device else host.to(x.device)  # on a GPU the test fails and it moves
        return x + h
    sides = Sides()
    sides.side[host] = "host"
    x = torch.randn(3, 4)
    sides.side[x] = DEVICE
    with HostFactories(sides), dispatch_mode(sides.on_op):
        f(x)
    assert sides.first is None


def test_to_marks_what_it_moves_and_leaves_plain_attributes_unjudged():
    m = nn.Linear(2, 2)
    m.register_buffer("kept", torch.ones(2))
    m.plain = torch.ones(2)  # a cache a model sets up after it was moved is made on its device: not judged
    sides = Sides()
    device_sides(m, sides)
    assert sides.of(m.weight) == sides.of(m.bias) == sides.of(m.kept) == DEVICE
    assert sides.of(m.plain) is None


def test_the_check_leaves_no_gradient_behind():
    cfg = build_config(d_model=32, n_heads=4, causal=True)
    subject = make_subject(cfg, torch.device("cpu"), torch.float32, f"{TESTS / 'zoo_device.py'}:MaskOnInputDevice")
    (c,) = run_checks(subject, cfg, torch.device("cpu"), torch.float32, only=("device",)).checks
    assert c.status is Status.PASS
    assert all(p.grad is None for p in subject.module.parameters())
