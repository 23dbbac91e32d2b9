"""Two instances of a block share nothing that trains (tests/zoo_construction.py): a module from a mutable default
argument or a module-level cache is one object for every instance, so every layer of a stack built from the block
trains the same weights. The block's file is run once per command, as a program runs it once, so tblock's second
instance meets what the first shares (before, each build ran the file again and the sharing never showed)."""

import pytest
import torch
import zoo_training

import tblock_cli
from tblock_cli.checks import Status
from tblock_cli.checks.holdings import shared_parameters
from tblock_cli.checks.optimizer import broken_ties

from conftest import TESTS


def state_dict_check(name, d_model=32):
    return tblock_cli.check(f"{TESTS / 'zoo_construction.py'}:{name}", d_model=d_model, n_heads=4, threads=1,
                            causal=True, only="state_dict").checks[0]


@pytest.mark.parametrize("name, shared", [("NormAsDefaultArgument", ["ffn_norm.weight"]),
                                          ("ProjectionFromModuleCache", ["o_proj.weight"])])
def test_a_module_every_instance_shares_is_named(name, shared):
    for d_model in (32, 48):
        c = state_dict_check(name, d_model)
        assert c.status is Status.FAIL and c.kind == "state_dict.shared" and c.facts["shared"] == shared, c
        assert "every layer of a stack" in c.detail


def test_a_frozen_table_every_instance_shares_is_a_design():
    report = tblock_cli.check(f"{TESTS / 'zoo_construction.py'}:FrozenTableFromModuleCache", d_model=32, n_heads=4,
                              threads=1, causal=True)
    assert not [(c.name, c.detail) for c in report.checks if c.status in (Status.FAIL, Status.ERROR, Status.WARN)]


def test_shared_parameters_reads_storage_not_names():
    a, b = zoo_training.TrainBlock(32, 4), zoo_training.TrainBlock(32, 4)
    assert shared_parameters(a, b) == []
    b.w2.weight = a.w2.weight  # one Parameter under the same name
    b.w1.weight = torch.nn.Parameter(a.w3.weight.data)  # another Parameter object over a's storage, another name
    assert shared_parameters(a, b) == ["w1.weight", "w2.weight"]
    b.w2.weight.requires_grad_(False)  # frozen: a design
    assert shared_parameters(a, b) == ["w1.weight"]


def test_layers_deep_copied_from_one_are_no_broken_tie():
    # nn.TransformerEncoder's layers are deep copies of one: equal at init, independent after (optimizer_step failed
    # torch's own stack as a tie broken by a copy); one tensor copied between entries is still a broken tie
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                      enable_nested_tensor=False)
    assert broken_ties(enc) == []
    layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
    layers[1].weight.data.copy_(layers[0].weight.data)
    assert broken_ties(layers) == [["0.weight", "1.weight"]]
    layers[1].bias.data.copy_(layers[0].bias.data)
    assert broken_ties(layers) == []
    report = tblock_cli.check(f"{TESTS / 'zoo_construction.py'}:TorchEncoderStack", d_model=32, n_heads=4, threads=1)
    assert not [(c.name, c.detail) for c in report.checks if c.status in (Status.FAIL, Status.ERROR, Status.WARN)]
