"""What each popular `hf:` layer says of itself (card/own.py's reading of its config and modules) against its card:
the check leaves hf: layers out of this judgement, so this script is where the reading is measured on them.

    python scripts/own_claims_sweep.py            # every popular type of hf_sweep.py, one line each
    python scripts/own_claims_sweep.py llama phi  # some types
    python scripts/own_claims_sweep.py my_block.py:Block  # a block of one's own, with its constructor's arguments

A line reads TYPE ok|DIFFERS|no claims|ERROR, with each claimed entry's verdict.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_sweep import POPULAR  # noqa: E402

from tblock_cli.card.attention import SCALE_SEQ  # noqa: E402
from tblock_cli.card.entries import judge  # noqa: E402
from tblock_cli.card.own import own_claims  # noqa: E402
from tblock_cli.card.own_fit import fitted, needed  # noqa: E402
from tblock_cli.card.own_layers import with_layer_claims  # noqa: E402
from tblock_cli.card.read import read_card  # noqa: E402
from tblock_cli.checks.training import all_modules  # noqa: E402
from tblock_cli.subject.loading import constructed_arguments  # noqa: E402
from tblock_cli.subject.setup import setup  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    differs = 0
    for t in sys.argv[1:] or POPULAR:
        try:
            own = ":" in t  # a file:Class block, else a transformers type
            s = setup(t if own else f"hf:{t}", {"threads": 1, "d_model": 64, "n_heads": 4} if own else {"threads": 1})
            subject = s.make()
            modules = all_modules(subject.module)
            arguments = constructed_arguments(subject.module) if own else {}
            claims = with_layer_claims(own_claims(modules, arguments), modules, arguments)
            if not claims:
                print(t, "no claims", flush=True)
                continue
            keys = needed(claims) + ("moe.experts", "attn.head_dim", "rope.dims")
            card = read_card(subject, s.cfg, s.device, keys=keys)
            claims = fitted(claims, card, SCALE_SEQ, s.cfg.d_model)  # as the check does
            verdicts = judge(card, claims)
            bad = [v.to_dict() for v in verdicts if v.status == "differs"]
            differs += bool(bad)
            print(t, "DIFFERS" if bad else "ok", {v.key: v.status for v in verdicts}, bad or "", flush=True)
        except Exception as e:  # noqa: BLE001 - a type that does not build is one line
            print(t, "ERROR", type(e).__name__, str(e)[:150], flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
