import pytest
import torch
import torch.nn as nn

from tblock_cli.config import build_config
from tblock_cli.subject.builtin import Block, Stack, build_block
from tblock_cli.subject.reference import reference_output


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_equals_torch_encoder_layer(norm, activation, causal):
    cfg = build_config(d_model=32, n_heads=4, norm=norm, activation=activation, causal=causal, seq=7)
    block = build_block(cfg).eval()
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        assert torch.allclose(block(x), reference_output(block, cfg, x), atol=1e-5)
        # and with grad enabled (the SDPA path rather than the fast path)
    with torch.enable_grad():
        assert torch.allclose(block(x), reference_output(block, cfg, x), atol=1e-5)


def test_pre_ln_written_out_by_hand():
    """x + MHA(LN1(x)), then + FFN(LN2(x)): recomputed from the parts, not from the module's forward."""
    cfg = build_config(d_model=16, n_heads=2, dropout=0.0)
    b = build_block(cfg).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        h = b.ln1(x)
        x1 = x + b.attn(h, h, h, need_weights=False)[0]
        y = x1 + b.ffn.fc2(nn.functional.gelu(b.ffn.fc1(b.ln2(x1))))
        assert torch.allclose(b(x), y, atol=1e-6)


def test_stack_gets_final_norm_only_when_pre():
    pre = build_block(build_config(layers=3, d_model=16, n_heads=2))
    post = build_block(build_config(layers=3, d_model=16, n_heads=2, norm="post"))
    assert isinstance(pre, Stack) and pre.final_ln is not None
    assert isinstance(post, Stack) and post.final_ln is None
    assert isinstance(build_block(build_config(d_model=16, n_heads=2)), Block)


def test_mixed_stack_alternates():
    s = build_block(build_config(layers=4, d_model=16, n_heads=2, norm="mixed", allow_mixed=True))
    assert [b.norm for b in s.layers] == ["pre", "post", "pre", "post"]
    assert s.final_ln is None  # the last layer is Post-LN: its output is already normalised


def test_no_bias_means_no_bias_anywhere():
    b = build_block(build_config(d_model=16, n_heads=2, bias=False))
    assert not [n for n, _ in b.named_parameters() if "bias" in n]


def test_seed_fixes_weights():
    a = build_block(build_config(d_model=16, n_heads=2, seed=3))
    b = build_block(build_config(d_model=16, n_heads=2, seed=3))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
