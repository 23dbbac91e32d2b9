"""The spec card read on a device apart from the CPU (tests/simulated_device.py: a second device simulated on the CPU,
in a process of its own) equals the card read on the CPU. On an H100 the attention and positions readers slipped on
every block (scores kept on the CPU met q and k on the device; a CPU index tensor written with the device's), and a
rotary block's claims went unjudged there."""

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from simulated_device import registered, simulated_device
from tblock_cli.card.read import read_card
from tblock_cli.subject.setup import setup
dev = registered()
out = {{}}
for spec in {blocks!r}:
    s = setup(spec, {{"d_model": 32, "n_heads": 4, "threads": 1, "causal": True, "seq": 8}}, trains=False)
    with s.session():
        subject = s.build(lambda cfg, n: 0, "spec")
        here = read_card(subject, s.cfg, torch.device("cpu"), keys={keys!r})
        with simulated_device():
            there = read_card(subject, s.cfg, dev, keys={keys!r})
    out[spec] = {{"slips": list(there.slips) + list(here.slips),
                 "cpu": [repr(e.value) for e in here.entries], "device": [repr(e.value) for e in there.entries]}}
print(json.dumps(out))
"""
# A rotary block with a soft-cap it keeps (positions and attention readers), ALiBi and a learned relative bias.
BLOCKS = [f"{TESTS / 'zoo_tables.py'}:SoftcapNotDivided", f"{TESTS / 'zoo.py'}:Alibi3",
          f"{TESTS / 'zoo.py'}:RelativeBiasBeforeSoftmax"]
KEYS = ("attn.scale", "attn.softcap", "pos.kind", "rope.theta", "rope.pairing", "alibi.slopes", "relbias.steps")


def test_the_card_read_on_another_device_equals_the_cards_read_on_the_cpu():
    script = SCRIPT.format(tests=str(TESTS), blocks=BLOCKS, keys=KEYS)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for spec, card in got.items():
        assert card["slips"] == [], (spec, card["slips"])
        assert card["device"] == card["cpu"], spec
        assert any(v not in ("None",) for v in card["cpu"]), spec  # something was read
