"""The torch functions tblock recognises by name, and the causal mask: one vocabulary for anatomy, checks and bench."""

from __future__ import annotations

import torch

# Activation functions (elementwise nonlinearities an FFN puts between its projections).
ACTIVATIONS = {"gelu", "gelu_", "relu", "relu_", "silu", "silu_", "sigmoid", "tanh", "softplus", "mish", "elu", "selu", "celu",
               "leaky_relu", "hardswish", "hardsigmoid", "hardtanh", "relu6", "glu", "erf", "quick_gelu", "logsigmoid"}
# Functions that are linear in each tensor argument (or only move data). Anything not listed counts as a
# nonlinearity, so a finding that needs "no nonlinearity here" stays conservative.
LINEAR = {"add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__", "rsub", "__isub__", "neg",
          "__neg__", "view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "split", "chunk",
          "unbind", "__getitem__", "squeeze", "unsqueeze", "expand", "expand_as", "clone", "to", "type", "float", "half",
          "bfloat16", "double", "type_as", "dropout", "dropout_", "cat", "stack", "concat", "concatenate", "masked_fill", "masked_fill_",
          "narrow", "select", "repeat", "repeat_interleave", "view_as", "reshape_as", "movedim", "swapaxes", "roll", "flip",
          "split_with_sizes", "tensor_split", "t", "mT", "detach", "sum", "mean", "pad", "index_select", "gather", "tile"}
# Ops that only lay one tensor's values out again (a head split, a cast): a projection's output stays one through them.
RELAYOUTS = {"view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten", "split", "chunk", "unbind",
             "__getitem__", "squeeze", "unsqueeze", "to", "float", "half", "bfloat16", "double", "type_as", "narrow",
             "select", "view_as", "reshape_as", "movedim", "swapaxes", "split_with_sizes", "tensor_split", "clone"}
# Casts and views whose tensor arguments past the first only lend a dtype, device or shape (x.to(q), x.type_as(q),
# x.expand_as(q)): data flows from the first alone, so a cache cast to q's dtype does not become q.
TEMPLATED = {"to", "type_as", "expand_as", "view_as", "reshape_as"}
# Writes that put one tensor's data into another (a KV cache filled in place: cache[:, pos] = k, cache.copy_(k),
# cache.index_copy_(1, pos, k)): the destination then holds what it held and what was written. Integer index tensors
# only say where.
WRITES = {"__setitem__", "copy_", "index_copy_", "index_copy", "index_put_", "index_put"}
# Multiplications and divisions: linear in one argument when the other is a constant.
SCALING = {"mul", "mul_", "__mul__", "__rmul__", "__imul__", "div", "div_", "__truediv__", "true_divide", "__itruediv__"}
# The scalings whose operands may come in either order (a division is one only with its dividend first).
MULTIPLIES = {"mul", "mul_", "__mul__", "__rmul__", "__imul__"}
# Ops that take part of a tensor: one expert of a stacked 3-D weight, a range of a 2-D weight's rows, a split's parts.
SLICES = {"__getitem__", "index_select", "narrow", "split", "chunk", "split_with_sizes", "tensor_split"}
# Concatenations: of weight matrices, one fused weight made on the fly (its projection is each part's).
CATS = {"cat", "concat", "concatenate"}
# Products of two tensors (q.k scores, weights x values) and projections by a weight matrix.
MATMULS = {"matmul", "__matmul__", "bmm", "einsum", "mm", "baddbmm"}
PROJECTIONS = {"linear", "addmm", "matmul", "__matmul__", "mm"}
SOFTMAX = {"softmax", "_softmax"}
NORMS = {"layer_norm", "rms_norm", "group_norm"}
ADDS = {"add", "__add__", "__radd__", "__iadd__", "add_"}
# Attribute and metadata calls that do no arithmetic: not worth a clock or a provenance entry.
QUIET = {"__get__", "__set__", "dim", "size", "stride", "is_floating_point", "is_contiguous", "numel", "data_ptr", "element_size",
         "requires_grad_", "__len__", "__format__", "__bool__", "get_device", "__hash__", "__eq__"}


def causal_mask(L: int, S: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, S) bool, True where query i may not attend to key j: j > i + (S - L) (new queries sit at the end)."""
    S = L if S is None else S
    return torch.ones(L, S, dtype=torch.bool, device=device).triu(S - L + 1)
