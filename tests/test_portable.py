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
