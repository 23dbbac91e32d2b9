"""Regenerate docs/report-COMMAND.png: each command's --html page at small sizes, shot by headless Chromium.

    python scripts/report_screenshots.py            # needs chromium (or google-chrome) on PATH, and Pillow

Each page is written by the CLI itself, then rendered by the browser (no network); the PNGs are reduced to a
palette so the docs stay small.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--d-model", "64", "--n-heads", "4", "--threads", "1"]
PAGES = {
    "check": ["check", "--block", "examples/my_block.py:MyBlock", "--causal", *SMALL],
    "params": ["params", *SMALL],
    "bench": ["bench", *SMALL, "--seq", "32,64,128,256", "--min-time", "0.1"],
    "depth": ["depth", "--compare", "--layers", "8", *SMALL],
    "compare": ["compare", "builtin", "builtin", "--dtype-b", "bfloat16", *SMALL],
    # a rotary layer declared as another: the card, the verdicts, and its frequencies drawn against theta
    "spec": ["spec", "--block", "examples/llama_layer.py:LlamaLayer", "--kwargs", "{\"rope_theta\": 500000}", "--like",
             "hf:llama", "--like-kwargs", "{\"rope_theta\": 500000}", "--d-ff", "256", *SMALL],
}
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WINDOW = (1100, 1400)


def main() -> int:
    from PIL import Image

    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        print("no chromium or google-chrome on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for command, args in PAGES.items():
            page = Path(tmp) / f"{command}.html"
            subprocess.run([sys.executable, "-m", "tblock_cli", *args, "--html", str(page)], cwd=ROOT,
                           stdout=subprocess.DEVNULL, check=False)  # exit 1 (a finding) still writes the page
            shot = ROOT / "docs" / f"report-{command}.png"
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--user-data-dir={Path(tmp) / 'profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                            f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
            Image.open(shot).convert("RGB").quantize(colors=96).save(shot, optimize=True)
            print(f"wrote {shot.relative_to(ROOT)} ({shot.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
