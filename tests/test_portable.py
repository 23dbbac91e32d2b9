"""A block's code meeting this machine: CUDA placements in a constructor where CUDA is absent, and a missing optional
dependency named with its install command (one line, exit 2)."""

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.errors import LoadError
from tblock_cli.subject.loading import construct, load_factory, make_subject

CPU = torch.device("cpu")
runner = CliRunner()
SMALL = ["--d-model", "64", "--n-heads", "4", "--threads", "1"]

CUDA_BLOCK = '''
import torch
import torch.nn as nn

class CudaBlock(nn.Module):
    def __init__(self, d_model=64):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model).cuda()
        self.cache = torch.zeros(2, d_model).cuda()  # a plain attribute, as Meta's llama keeps its KV cache
        self.scale = torch.full((d_model,), 0.5, device="cuda")
        self.register_buffer("shift", torch.ones(d_model).to("cuda"))

    def forward(self, x):
        return x + self.proj(x) * self.scale + self.shift
'''

MISSING = '''
import torch.nn as nn

class LazyImport(nn.Module):
    def __init__(self, d_model=64):
        super().__init__()
        import tblock_absent_dependency.layers  # an optional dependency, imported where it is used

    def forward(self, x):
        return x
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the constructor's own placements stand")
def test_cuda_placements_are_built_on_the_device_at_hand(tmp_path):
    (tmp_path / "cuda_block.py").write_text(CUDA_BLOCK)
    spec = f"{tmp_path / 'cuda_block.py'}:CudaBlock"
    cfg = build_config(d_model=64, n_heads=4)
    block = make_subject(cfg, CPU, torch.float32, spec).module
    assert block.proj.weight.device == CPU and block.cache.device == CPU and block.shift.device == CPU
    assert torch.equal(block.scale, torch.full((64,), 0.5)) and torch.equal(block.shift, torch.ones(64))
    x = torch.randn(2, 5, 64)
    assert torch.equal(block(x), x + block.proj(x) * 0.5 + 1)  # computed as the code says, on the CPU
    with torch.device("meta"):  # a rebuild on the meta device: the placements follow it
        meta = construct(spec, load_factory(spec), cfg, {})
    assert meta.cache.device.type == "meta" and meta.proj.weight.device.type == "meta"
    with pytest.raises((AssertionError, RuntimeError)):  # outside the constructor, .cuda() is CUDA's again
        torch.zeros(1).cuda()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the constructor's own placements stand")
def test_cuda_block_checks_from_the_cli(tmp_path):
    (tmp_path / "cuda_block.py").write_text(CUDA_BLOCK)
    result = runner.invoke(app, ["params", "--block", f"{tmp_path / 'cuda_block.py'}:CudaBlock", *SMALL, "--json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("where", ["import", "construction"])
def test_missing_dependency_is_one_line_with_its_install_command(tmp_path, where):
    text = MISSING if where == "construction" else "import tblock_absent_dependency.layers\n" + MISSING
    (tmp_path / "needs_dep.py").write_text(text)
    spec = f"{tmp_path / 'needs_dep.py'}:LazyImport"
    result = runner.invoke(app, ["check", "--block", spec, *SMALL])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "'tblock_absent_dependency'" in line and line.endswith("pip install tblock_absent_dependency")


def test_an_installed_module_lacking_a_name_is_not_called_missing(tmp_path):
    # ImportError for a name torch does not have: a version mismatch, not a package to install
    (tmp_path / "bad_name.py").write_text("from torch import no_such_thing_here\nimport torch.nn as nn\nB = nn.Identity\n")
    with pytest.raises(LoadError) as e:
        load_factory(f"{tmp_path / 'bad_name.py'}:B")
    assert "pip install" not in str(e.value) and "no_such_thing_here" in str(e.value)


OUT_OF_RANGE = {  # an indexing op with one index past its dimension (or below it), as tblock's length probes meet them
    "embedding": lambda t, w: torch.nn.functional.embedding(torch.tensor([1, 10]), w),
    "advanced index": lambda t, w: t[:, torch.tensor([0, 5])],
    "negative index": lambda t, w: t[torch.tensor([-4])],
    "index assignment": lambda t, w: t.clone().__setitem__(torch.tensor([7]), 0.0),
    "gather": lambda t, w: t.gather(1, torch.tensor([[5]])),
    "scatter": lambda t, w: t.clone().scatter_(1, torch.tensor([[5]]), 1.0),
    "index_select": lambda t, w: t.index_select(0, torch.tensor([-1])),
    "index_add": lambda t, w: t.clone().index_add_(0, torch.tensor([3]), torch.ones(1, 5)),
    "take": lambda t, w: torch.take(t, torch.tensor([15])),
}


def _raised(fn) -> type | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e)
    return None


@pytest.mark.parametrize("op", list(OUT_OF_RANGE))
def test_indices_checked_before_the_op_raise_what_the_cpu_raises(op):
    """On a CUDA device an index out of range is a device-side assert that loses the process's CUDA context; the guard
    raises first, the exception the CPU's own op raises (here the guard is pointed at the CPU to compare the two)."""
    from tblock_cli.subject.portable import indices_checked

    t, w = torch.randn(3, 5), torch.randn(10, 4)
    fn = lambda: OUT_OF_RANGE[op](t, w)  # noqa: E731
    own = _raised(fn)
    with indices_checked(("cpu",)):
        guarded = _raised(fn)
    assert own is not None and guarded is own


def test_indices_in_range_and_boolean_masks_pass_the_guard_unchanged():
    from tblock_cli.subject.portable import indices_checked

    t = torch.randn(3, 5)
    with indices_checked(("cpu",)):
        got = [t[torch.tensor([-3, 2])], t[torch.tensor([True, False, True]), torch.tensor([4, 0])], t.gather(1, torch.tensor([[4]]))]
    assert all(torch.equal(a, b) for a, b in zip(got, [t[[0, 2]], torch.stack((t[0, 4], t[2, 0])), t[:1, 4:5]]))


def test_the_battery_under_the_index_guard_reports_what_it_reports_without(monkeypatch):
    """A relative-bias table of 127 offsets, indexed past its end by the probes of sequences longer than 64 (history's
    twice-as-long input at seq 64): the same report with the guard on (what a CUDA device runs) as without, and the
    guard did raise."""
    import tblock_cli
    from tblock_cli.subject import portable

    spec, sizes = "tests/zoo_attention.py:RelativeBiasBeforeSoftmax", dict(d_model=32, n_heads=4, seq=64, threads=1)
    plain = tblock_cli.check(spec, **sizes)
    raised = []
    own = portable._checked

    def counted(*args):
        try:
            own(*args)
        except IndexError:
            raised.append(args[1])
            raise

    monkeypatch.setattr(portable, "_checked", counted)
    monkeypatch.setattr(portable, "indexes_checked", lambda device: portable.indices_checked(("cpu",)))
    guarded = tblock_cli.check(spec, **sizes)
    assert raised and plain.ok
    assert [(c.name, c.status, c.kind) for c in guarded.checks] == [(c.name, c.status, c.kind) for c in plain.checks]
