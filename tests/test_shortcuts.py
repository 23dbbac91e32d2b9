"""What keeps check cheap on big layers does not change what it computes: the streamed float64 reference equals
a whole float64 copy, the gradient states equal the gradients' own, the selection of checks is validated."""

import copy

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import tblock_cli
from tblock_cli.checks.battery import CHECK_NAMES, select
from tblock_cli.checks.gradients import grad_state
from tblock_cli.checks.streamed import float64_streamed, stream_units
from tblock_cli.config import build_config
from tblock_cli.errors import ConfigError
from tblock_cli.probes import residual_probes
from tblock_cli.subject.loading import make_subject

from conftest import TESTS

CPU = torch.device("cpu")


def test_streamed_float64_equals_a_float64_copy_and_restores_the_block(monkeypatch):
    import tblock_cli.checks.streamed as streamed

    monkeypatch.setattr(streamed, "STREAM_UNIT_BYTES", 1024)  # small units even at d_model 32: streaming happens
    cfg = build_config(d_model=32, n_heads=4, layers=2)
    block = make_subject(cfg, CPU, torch.float32).module.eval()
    units = stream_units(block)
    assert len(units) > 3 and block not in units  # cast piece by piece, not whole
    before = {k: v.clone() for k, v in block.state_dict().items()}
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = copy.deepcopy(block).double()(x)
        with float64_streamed(block, CPU):
            got = block(x)
    assert got.dtype == torch.float64 and torch.equal(got, expected)
    after = block.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert not block._forward_hooks and not block._forward_pre_hooks


def test_grad_state_matches_the_gradient():
    assert grad_state(None) == "none"
    assert grad_state(torch.zeros(3)) == "zero"
    assert grad_state(torch.tensor([0.0, 1.0])) == "ok"
    assert grad_state(torch.tensor([1.0, float("nan")])) == "nonfinite"
    assert grad_state(torch.tensor([float("inf"), float("-inf")])) == "nonfinite"  # sums to NaN
    assert grad_state(torch.tensor([3e38, 3e38])) == "ok"  # the sum overflows, the elements are finite


def test_residual_probes_keep_eight_at_the_default_input_and_fewer_on_big_ones():
    assert residual_probes(2 * 10 * 32) == 8 and residual_probes(2 * 10 * 512) == 8
    assert residual_probes(2 * 10 * 1024) == 4 and residual_probes(2 * 10 * 4096) == 1


def test_selection_only_skip_fast():
    assert select() is None
    assert select(only="shape,finite") == ("shape", "finite")
    assert "dtype" not in select(skip=["dtype"]) and len(select(skip=["dtype"])) == len(CHECK_NAMES) - 1
    fast = select(fast=True)
    assert "kv_cache" not in fast and "dtype" not in fast and "residual" in fast
    with pytest.raises(ConfigError, match="did you mean residual"):
        select(only="residal")


def test_only_runs_the_named_checks_and_reports_a_total():
    report = tblock_cli.check(d_model=32, n_heads=4, threads=1, only=["shape", "residual"])
    assert [c.name for c in report.checks] == ["shape", "residual"]
    # on the report's own grid (seconds rounded to 4 decimals): 0.0012 + 0.0036 sums to 0.0048000000000000004 in floats
    assert report.seconds >= round(sum(c.seconds for c in report.checks), 4) > 0


def test_progress_hears_checks_and_probes():
    heard = []
    tblock_cli.check(d_model=32, n_heads=4, threads=1, only="residual,dtype", progress=lambda n, d=None: heard.append((n, d)))
    assert ("residual", None) in heard and ("dtype", "float64 forward") in heard
    assert any(n == "residual" and d and "Jacobian" in d for n, d in heard)


def test_cli_refuses_a_misspelt_check_with_exit_2():
    from tblock_cli.cli import app

    res = CliRunner().invoke(app, ["check", "--d-model", "32", "--n-heads", "4", "--skip", "kv_cach"])
    assert res.exit_code == 2 and "kv_cache" in res.stderr


@pytest.mark.xdist_group("hf")  # with the other transformers tests (tests/test_hf.py)
def test_hf_init_once_keeps_what_transformers_init_writes():
    pytest.importorskip("transformers")
    from transformers import AutoModel

    from tblock_cli.subject import hf
    from tblock_cli.subject.hf.init import _marked, from_config_once

    config = hf.build_config("llama", build_config(d_model=32, n_heads=4), {})
    torch.manual_seed(0)
    model = from_config_once(AutoModel, config)
    assert not _marked(model)
    w = model.layers[0].mlp.gate_proj.weight
    assert abs(w.std().item() - config.initializer_range) < 0.005  # transformers' normal_(0, 0.02), not kaiming

    class Custom(nn.Module):  # a parameter only torch's default init writes: the build starts over
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class Auto:
        @staticmethod
        def from_config(_config):
            return Custom()

    assert not _marked(from_config_once(Auto, None))


def test_check_and_bench_do_not_import_sympy_or_inductor():
    """torch imports sympy for symbolic shapes (an explicit gradient to backward() checks its shape with them), and
    torch.profiler.profile imports inductor: 3-5 s of a command's start-up, and neither is needed. The whole default
    battery leaves dynamo out too (1.7 s: a TorchDispatchMode subclass imports it at its first op unless told not to,
    torch.optim at its first step)."""
    import subprocess
    import sys

    code = ("import sys, tblock_cli; tblock_cli.check(d_model=32, n_heads=4, threads=1); "
            "print('sympy' in sys.modules, 'torch._dynamo' in sys.modules); "
            "tblock_cli.bench(d_model=32, n_heads=4, threads=1, seq=[8], mode='train', min_time=0.01, breakdown=True); "
            "print('sympy' in sys.modules, 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False False", "False False"], out


def test_a_meta_device_build_leaves_dynamo_out_and_a_later_compile_gets_the_real_one():
    """meta_init builds a rotary block on the meta device, where `1.0 / base ** (...)` runs torch's Python reference,
    which asks torch._dynamo to disable itself (1.2-2.3 s of import). The build runs against a stub; after it dynamo
    is still not imported, the functions keep no cached stub, and a compile afterwards traces with the real one."""
    import subprocess
    import sys

    code = ("import sys, torch, tblock_cli; "
            f"r = tblock_cli.check(r'{TESTS / 'zoo_training.py'}:TrainBlock', d_model=32, n_heads=4, threads=1, "
            "only='meta_init'); "
            "print(r.checks[0].status.value, 'torch._dynamo' in sys.modules); "
            "f = torch.compile(lambda t: 1.0 / (t + 1), backend='eager'); "
            "print(bool(f(torch.ones(2)).eq(0.5).all()), type(sys.modules['torch._dynamo'].disable).__name__, "
            "hasattr(sys.modules['torch._dynamo'], 'optimize'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["pass False", "True function True"], out


class ModelKeptAside(nn.Module):
    """A residual layer whose train() also sets a module it keeps outside its module tree, as tblock's HF wrapper
    sets its model's: kept_modes restores the tree's modes only, so that module's mode moves with the last caller."""

    def __init__(self, d: int):
        super().__init__()
        self.ff = nn.Linear(d, d)
        self.__dict__["aside"] = nn.Linear(d, d)  # not a submodule

    def train(self, mode: bool = True):
        self.aside.train(mode)
        return super().train(mode)

    def forward(self, x):
        return x + self.ff(x)


def test_the_standard_forward_runs_once_whatever_modes_the_checks_leave():
    """input_unchanged's training step leaves the kept-aside module in train mode; residual's standard eval output is
    still the one shape computed (its forward would run in eval mode all the same)."""
    block = ModelKeptAside(16)
    standard_inputs = []

    def record(m, args):
        if not m.training and not torch.is_grad_enabled():
            standard_inputs.append(args[0].clone())

    block.register_forward_pre_hook(record)
    tblock_cli.check(block, d_model=16, threads=1, only=["shape", "input_unchanged", "residual"])
    # the standard input: the one residual also runs doubled (2 * x0, its after-norm probe)
    (x0,) = {id(x): x for x in standard_inputs if any(torch.equal(2 * x, y) for y in standard_inputs)}.values()
    assert sum(torch.equal(x, x0) for x in standard_inputs) == 1


class PositionsSlice(nn.Module):
    """Returns a view of its own weight (a learned position table's first T rows), read after later modules ran."""

    def __init__(self, d: int):
        super().__init__()
        self.pe = nn.Parameter(torch.randn(16, d))

    def forward(self, T: int):
        return self.pe[:T]


class LateSum(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.pos, self.ff, self.ff2 = PositionsSlice(d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        p = self.pos(x.shape[1])
        return self.ff2(self.ff(x)) + p  # ff and ff2 are cast after pos returned


def test_streamed_float64_keeps_a_units_output_that_views_its_copies(monkeypatch):
    """The float64 copies of one unit are laid into a buffer the next unit reuses, unless the unit kept a view of them:
    pos's output is its weight's float64 copy, and ff's and ff2's copies must not overwrite it."""
    import tblock_cli.checks.streamed as streamed

    monkeypatch.setattr(streamed, "STREAM_UNIT_BYTES", 64)
    block = LateSum().eval()
    assert stream_units(block) == [block.pos, block.ff, block.ff2]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = copy.deepcopy(block).double()(x)
        with float64_streamed(block, CPU):
            got = block(x)
            again = block(x)  # a second forward reuses nothing stale
    assert torch.equal(got, expected) and torch.equal(again, expected)
