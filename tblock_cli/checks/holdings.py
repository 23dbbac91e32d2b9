"""What a block's instances hold: the modules whose state_dict saving it saves (roots), parameters kept out of the
module tree (hidden_params), parameters a second instance shares with the first (shared_parameters, sibling_shares)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tblock_cli.checks.training import all_modules, forked
from tblock_cli.errors import USER_ERRORS, is_out_of_memory


def roots(module: nn.Module) -> list[nn.Module]:
    """The module and the modules it keeps as plain attributes (an HF layer's model), none inside another: each
    one's state_dict is what saving the block saves."""
    out, covered, todo = [], set(), [module]
    while todo:
        m = todo.pop(0)
        if id(m) in covered:
            continue
        out.append(m)
        inside = list(m.modules())
        covered |= {id(c) for c in inside}
        todo += [v for c in inside for k, v in vars(c).items() if isinstance(v, nn.Module) and k != "_modules"]
    return out


def hidden_params(module: nn.Module) -> list[str]:
    """nn.Parameters kept in a plain list, tuple or dict attribute: never registered, never trained, never saved."""
    registered = {id(p) for r in roots(module) for p in r.parameters()}
    found = []
    for m in all_modules(module):
        for k, v in vars(m).items():
            values = v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) and not k.startswith("_") else ()
            found += [f"{type(m).__name__}.{k}[{i}]" for i, e in enumerate(values) if isinstance(e, nn.Parameter) and id(e) not in registered]
    return found


def shared_parameters(module: nn.Module, fresh: nn.Module) -> list[str]:
    """The trainable parameters of a second instance, built by the block's own class or function, whose storage is one
    of the first instance's: a module given as a default argument, kept as a class attribute or fetched from a
    module-level cache is one object for every instance, so each layer of a stack built from the factory trains the
    same weights. A frozen table shared between instances (one rotary cache for every layer) is a design, left out."""
    def stored(p) -> bool:  # a lazy module's parameter has no shape yet, a meta one no storage
        return not isinstance(p, nn.parameter.UninitializedTensorMixin) and p.device.type != "meta" and p.numel() > 0

    mine = {p.untyped_storage().data_ptr() for p in module.parameters() if stored(p)}
    return [n for n, p in fresh.named_parameters()
            if p.requires_grad and stored(p) and p.untyped_storage().data_ptr() in mine]


def sibling_shares(module: nn.Module, sibling, device: torch.device) -> list[str]:
    """shared_parameters of the block and a sibling built on the meta device (its own parameters have no storage there:
    only what it shares has). The global RNG is put back after, and so is the block's state, which a constructor that
    initialises what it shares would write into; [] where the sibling cannot be built (its own error shows elsewhere)."""
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        with forked(device):
            other = sibling()
    except USER_ERRORS as e:
        if is_out_of_memory(e):
            raise
        return []
    finally:
        with torch.no_grad():
            for k, v in module.state_dict().items():
                if not torch.equal(v, saved[k]):
                    v.copy_(saved[k])
    return shared_parameters(module, other)
