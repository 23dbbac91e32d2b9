"""What a module is made of: its attention, FFN and norm parameters, found from the module tree."""

from __future__ import annotations

import inspect
import re

import torch.nn as nn

GROUPS = ("attention", "ffn", "norm", "other")
# Module names that mark attention (anywhere in the path) or the FFN, after common code bases:
# nanoGPT (attn, c_attn, mlp, c_fc), Llama (q_proj..o_proj, wq..wo, gate/up/down, w1..w3), BERT
# (query, key, value, intermediate), PyTorch (self_attn, linear1, linear2).
_ATTN = re.compile(r"attn|attention|^(q|k|v|o|qkv|kv|out)_?proj$|^w[qkvo]$|^(query|key|value)$", re.I)
_FFN = re.compile(r"^(ffn|mlp|ff|feed_?forward|fc\d*|c_fc|linear\d*|w\d|gate(_proj)?|up(_proj)?|down(_proj)?|intermediate)$", re.I)


def attention_modules(module: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)]


def norm_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that normalise with an `eps` floor: LayerNorm, RMSNorm and look-alikes by class name."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "eps", None), (int, float))
    ]


def classify(module: nn.Module) -> dict[str, str]:
    """Each parameter's qualified name -> attention | ffn | norm | other (shared tensors once)."""
    owners = dict(module.named_modules())
    groups: dict[str, str] = {}
    for pname, _ in module.named_parameters():  # named_parameters already yields a shared tensor once
        path = pname.split(".")[:-1]
        chain = [owners[".".join(path[:i])] for i in range(len(path) + 1)]
        owner = chain[-1]
        if "norm" in type(owner).__name__.lower() or any(p.startswith(("ln", "norm")) for p in path[-1:]):
            groups[pname] = "norm"
        elif any(isinstance(m, nn.MultiheadAttention) for m in chain) or any(_ATTN.search(p) for p in path):
            groups[pname] = "attention"
        elif isinstance(owner, nn.Linear) or any(_FFN.match(p) for p in path):
            groups[pname] = "ffn"
        else:
            groups[pname] = "other"
    return groups


def group_counts(module: nn.Module) -> dict[str, int]:
    params = dict(module.named_parameters())
    counts = dict.fromkeys(GROUPS, 0)
    for name, group in classify(module).items():
        counts[group] += params[name].numel()
    return counts


def predicted_ffn_share(mats: dict[str, int]) -> float:
    """The FFN share its weight matrices alone predict: ffn / (ffn + attention).

    With attention holding 4 d^2 and the FFN 2 d d_ff this is 2r / (4 + 2r), r = d_ff / d: 2/3 at r = 4.
    """
    return mats["ffn"] / (mats["ffn"] + mats["attention"]) if mats["attention"] else 1.0


def matrix_counts(module: nn.Module) -> dict[str, int]:
    """Like group_counts, but only weight matrices (ndim >= 2): the 2/3 rule sets biases and norms aside."""
    params = dict(module.named_parameters())
    counts = dict.fromkeys(GROUPS, 0)
    for name, group in classify(module).items():
        if params[name].ndim >= 2:
            counts[group] += params[name].numel()
    return counts


def mha_call_arguments(mha: nn.MultiheadAttention, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """How an nn.MultiheadAttention was called, defaults filled in (need_weights=True when not passed)."""
    bound = inspect.signature(mha.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def attention_weights_bytes(mha: nn.MultiheadAttention, bound: inspect.BoundArguments) -> int:
    """Bytes of the attention weights one call returns: (B, L, S), or (B, H, L, S) unaveraged."""
    q, k = bound.arguments["query"], bound.arguments["key"]
    batched = q.dim() == 3
    B = (q.shape[0] if mha.batch_first else q.shape[1]) if batched else 1
    L = q.shape[-2] if (mha.batch_first or not batched) else q.shape[0]
    S = k.shape[-2] if (mha.batch_first or not batched) else k.shape[0]
    heads = 1 if bound.arguments["average_attn_weights"] else mha.num_heads
    return B * heads * L * S * q.element_size()
