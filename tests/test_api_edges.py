"""The API and the caller's state: a TorchScript module refused with one error and left untouched, torch's global
random stream left where the caller had it."""

import pytest
import torch
import torch.nn as nn

import tblock_cli
from tblock_cli.errors import LoadError

S = {"d_model": 32, "n_heads": 4, "threads": 1, "seq": 8}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script is deprecated, and still used
def test_a_scripted_module_is_one_clear_error_and_stays_untouched():
    """Before: .grad filled on the caller's module, grad_params failed falsely and 7 checks errored."""
    m = torch.jit.script(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for call in (tblock_cli.check, tblock_cli.params):
        with pytest.raises(LoadError, match="TorchScript"):
            call(m, **S)
    with pytest.raises(LoadError, match="TorchScript"):
        tblock_cli.compare(m, "builtin", **S)
    assert all(p.grad is None and torch.equal(p, before[n]) for n, p in m.named_parameters())


@pytest.mark.parametrize("call", ["check", "params", "depth", "compare"])
def test_the_callers_random_stream_is_left_as_it_was(call):
    m = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    run = {"check": lambda: tblock_cli.check(m, only="shape", **S), "params": lambda: tblock_cli.params(m, **S),
           "depth": lambda: tblock_cli.depth(m, layers=2, **S), "compare": lambda: tblock_cli.compare(m, m, **S)}[call]
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    run()
    assert torch.equal(torch.rand(3), expected)


def test_a_block_that_calls_os_exit_cannot_end_the_callers_process():
    """A test suite calling tblock_cli.check on such a block ended with the block's exit code (0: a green run)."""
    import os

    from tblock_cli.errors import TBlockError

    class Exits(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            os._exit(0)

    real = os._exit
    with pytest.raises(TBlockError, match=r"os\._exit\(0\)"):
        tblock_cli.check(Exits(), **S)
    assert os._exit is real  # put back


def test_a_frozen_config_with_a_dropout_field_is_left_alone():
    """Dropout fields of a module's `config` are zeroed for a while (Hugging Face layers read them at call time); a
    frozen dataclass cannot be, and must not make train_eval or compare raise."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Config:
        dropout: float = 0.1

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.proj, self.drop = Config(), nn.Linear(32, 32), nn.Dropout(0.1)

        def forward(self, x):
            return x + self.drop(self.proj(x))

    by = {c.name: c for c in tblock_cli.check(Block(), only="shape,finite,determinism,train_state,copy,train_eval", **S).checks}
    assert by["train_eval"].status.value == "pass", by["train_eval"].detail
    assert tblock_cli.compare(Block(), Block(), **S).ok
