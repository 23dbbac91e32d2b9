"""Hugging Face layers driven as their model drives them: `--block hf:TYPE` with no adapter code.

The config comes from `AutoConfig.for_model(TYPE)` with tblock's sizes written into every size-dependent field
(`sizes`), random weights, no hub, no download. The layers are driven through their model's own forward (`drive`);
what tblock knows about particular families lives in `families`. transformers is imported only for an `hf:` block.
"""

from __future__ import annotations

from tblock_cli.subject.hf.drive import HFLayers, accepted
from tblock_cli.subject.hf.model import build, build_config, is_causal, rebuilder
from tblock_cli.subject.hf.sizes import import_transformers

__all__ = ["HFLayers", "accepted", "build", "build_config", "import_transformers", "is_causal", "rebuilder"]
