"""--block: specs, keyword aliases, the padding keyword, and one-line load errors with exit 2."""

import pytest
import torch
from typer.testing import CliRunner

from tblock_cli.cli import app
from tblock_cli.config import build_config
from tblock_cli.subject.loading import constructor_kwargs, make_subject

from conftest import TESTS, zoo_spec

CPU = torch.device("cpu")
runner = CliRunner()
SMALL = ["--d-model", "64", "--n-heads", "4"]


def load(spec, kwargs=None, **flags):
    cfg = build_config(**{"d_model": 32, "n_heads": 4, **flags})
    return make_subject(cfg, CPU, torch.float32, spec, kwargs)


def test_aliases_fill_the_signature():
    cfg = build_config(d_model=64, n_heads=4, dropout=0.0)
    kw, _ = constructor_kwargs(torch.nn.TransformerEncoderLayer, cfg)
    assert kw == {"d_model": 64, "nhead": 4, "dim_feedforward": 256, "dropout": 0.0, "batch_first": True}
    kw, _ = constructor_kwargs(torch.nn.MultiheadAttention, cfg)
    assert kw["embed_dim"] == 64 and kw["num_heads"] == 4 and kw["batch_first"] is True


def test_module_spec_and_kwargs():
    s = load("torch.nn:TransformerEncoderLayer", '{"norm_first": true}')
    assert s.module.norm_first is True and s.pad_keyword == "src_key_padding_mask"
    assert s.module.self_attn.batch_first is True


def test_file_spec_puts_its_folder_on_sys_path(tmp_path):
    (tmp_path / "helper_mod.py").write_text("import torch.nn as nn\nclass Inner(nn.Linear):\n    pass\n")
    (tmp_path / "myblock.py").write_text(
        "import torch.nn as nn\nfrom helper_mod import Inner\n"
        "class MyBlock(nn.Module):\n"
        "    def __init__(self, dim):\n        super().__init__()\n        self.f = Inner(dim, dim)\n"
        "    def forward(self, x, key_padding_mask=None):\n        return x + self.f(x)\n"
    )
    s = load(f"{tmp_path / 'myblock.py'}:MyBlock")
    assert s.module.f.in_features == 32 and s.pad_keyword == "key_padding_mask"



@pytest.mark.parametrize("spec, words", [
    ("no_such_package.mod:X", "cannot import module"),
    ("torch.nn:NoSuchLayer", "has no attribute 'NoSuchLayer'"),
    ("missing/file.py:X", "not found"),
    ("torch.nn", "expected package.module:NAME"),
    (zoo_spec("factory_raises"), "ValueError: bad width"),
    (zoo_spec("not_a_module"), "not a torch.nn.Module"),
    (zoo_spec("BrokenForward"), "RuntimeError: boom"),
    (zoo_spec("ReturnsDict"), "returned dict"),
])
def test_load_problems_are_one_line_exit_two(spec, words):
    for cmd in ("check", "params", "bench"):
        res = runner.invoke(app, [cmd, "--block", spec, *SMALL, "--min-time", "0.01"] if cmd == "bench" else [cmd, "--block", spec, *SMALL])
        assert res.exit_code == 2, (cmd, res.output)
        assert words in res.stderr and spec in res.stderr and "Traceback" not in res.output
        assert len(res.stderr.strip().splitlines()) == 1


def test_wrong_shape_is_a_failed_check_but_a_load_error_elsewhere():
    res = runner.invoke(app, ["check", "--block", zoo_spec("WrongShape"), *SMALL, "--json"])
    assert res.exit_code == 1
    res = runner.invoke(app, ["params", "--block", zoo_spec("WrongShape"), *SMALL])
    assert res.exit_code == 2 and "differs from the input's" in res.stderr


def test_bad_kwargs_json():
    res = runner.invoke(app, ["check", "--block", "torch.nn:TransformerEncoderLayer", *SMALL, "--kwargs", "{norm_first: true}"])
    assert res.exit_code == 2 and "not valid JSON" in res.stderr
    res = runner.invoke(app, ["check", *SMALL, "--kwargs", "{}"])
    assert res.exit_code == 2 and "--block" in res.stderr


@pytest.mark.parametrize("kwargs", [None, '{"norm_first": true}'])
def test_torch_encoder_layer_passes_from_the_cli(kwargs):
    args = ["check", "--block", "torch.nn:TransformerEncoderLayer", *SMALL] + (["--kwargs", kwargs] if kwargs else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output


def test_example_file_runs():
    spec = f"{TESTS.parent / 'examples' / 'my_block.py'}:MyBlock"
    res = runner.invoke(app, ["check", "--block", spec, "--d-model", "64", "--n-heads", "4", "--causal"])
    assert res.exit_code == 0, res.output


def test_a_block_raising_while_measured_is_one_line_exit_one():
    spec = zoo_spec("FailsWithGrad")
    for args in (["bench", "--seq", "8", "--min-time", "0.01", "--mode", "train"], ["depth", "--layers", "2"]):
        res = runner.invoke(app, [*args, "--block", spec, *SMALL])
        assert res.exit_code == 1, res.output
        assert "grad path broken" in res.stderr and "Traceback" not in res.output
    res = runner.invoke(app, ["check", "--block", spec, *SMALL, "--json"])
    assert res.exit_code == 1  # the battery reports it as errors, the other checks still run


def test_builtin_only_flags_are_warned_with_a_user_block():
    res = runner.invoke(app, ["params", "--block", "torch.nn:TransformerEncoderLayer", *SMALL, "--norm", "post", "--layers", "3"])
    assert res.exit_code == 0
    assert "warning: --norm, --layers shape(s) only the built-in block" in res.stderr
    res = runner.invoke(app, ["params", "--block", "torch.nn:TransformerEncoderLayer", *SMALL])
    assert "warning" not in res.stderr
