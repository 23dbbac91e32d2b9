"""The by-hand check of a Llama-7B-size layer that `tblock check --block hf:llama --d-model 4096 --n-heads 32
--d-ff 11008` is measured against: build the layer as transformers builds it, one forward and one backward,
finiteness asserts. Run: python scripts/yardstick_7b.py [--d-model 4096 --n-heads 32 --d-ff 11008]."""

import argparse

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

p = argparse.ArgumentParser()
p.add_argument("--d-model", type=int, default=4096)
p.add_argument("--n-heads", type=int, default=32)
p.add_argument("--d-ff", type=int, default=11008)
p.add_argument("--batch", type=int, default=2)  # tblock check's default input: (2, 10, d)
p.add_argument("--seq", type=int, default=10)
a = p.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=a.d_model, num_attention_heads=a.n_heads, num_key_value_heads=a.n_heads,
                     intermediate_size=a.d_ff, num_hidden_layers=1, vocab_size=256)
layer = LlamaDecoderLayer(config, layer_idx=0)
rotary = LlamaRotaryEmbedding(config)

x = torch.randn(a.batch, a.seq, a.d_model, requires_grad=True)
position_ids = torch.arange(a.seq).unsqueeze(0)
causal = torch.full((a.seq, a.seq), float("-inf")).triu(1)[None, None]  # additive (1, 1, T, T)
out = layer(x, attention_mask=causal, position_ids=position_ids, position_embeddings=rotary(x, position_ids))
out = out[0] if isinstance(out, tuple) else out
assert out.shape == x.shape, out.shape
assert torch.isfinite(out).all()
out.float().pow(2).mean().backward()
assert x.grad is not None and torch.isfinite(x.grad).all()
assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
print("ok", sum(p.numel() for p in layer.parameters()), "parameters")
