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


class LazyBlock(nn.Module):
    """A Pre-LN block whose linear layers are nn.LazyLinear: their shapes come from the first forward."""

    def __init__(self, d_model=32, n_heads=4, d_ff=64):
        super().__init__()
        self.n_heads = n_heads
        self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.o = nn.LazyLinear(3 * d_model), nn.LazyLinear(d_model)
        self.up, self.down = nn.LazyLinear(d_ff), nn.LazyLinear(d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(self.n1(x)).chunk(3, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(torch.nn.functional.gelu(self.up(self.n2(x))))


def test_a_block_with_lazy_modules_is_materialised_by_one_forward():
    """Before: a traceback counting an uninitialised parameter. Now a dry run gives the shapes, as a training
    script's does, and the fresh instances the training checks build are materialised the same way."""
    d, f = 32, 4 * 32  # tblock passes d_ff = 4 d_model by default
    total = tblock_cli.params(LazyBlock, **S).to_dict()["total"]
    assert total == 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    report = tblock_cli.check(LazyBlock, **S)
    bad = [(c.name, c.detail) for c in report.checks if c.status.value in ("fail", "warn", "error")]
    assert not bad, bad
