"""N interleaved pairs (yardstick, command, yardstick, command, ...) so both sides see the same machine load;
prints each run, the medians, the wall-time ratio and peak RSS (/usr/bin/time -f %M).

  python scripts/perf_pairs.py -n 5 --yardstick "python scripts/yardstick_small.py" -- python -m tblock_cli check --threads 1
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile


def timed(cmd: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in KiB, exit code) of one run, from /usr/bin/time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        r = subprocess.run(["/usr/bin/time", "-o", f.name, "-f", "%e %M", *cmd], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        wall, rss = f.read().split()[-2:]
    if r.returncode not in (0, 1):
        sys.stderr.write(r.stderr[-2000:])
    return float(wall), int(rss), r.returncode


def loadavg() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=5, help="pairs")
    p.add_argument("--yardstick", required=True, help="the by-hand command (a shell-quoted string)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command measured against it")
    a = p.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    yard = shlex.split(a.yardstick)
    ys, cs, loads = [], [], []
    for i in range(a.n):
        loads.append(loadavg())
        ys.append(timed(yard))
        cs.append(timed(cmd))
        print(f"pair {i + 1}: yardstick {ys[-1][0]:.2f} s {ys[-1][1] / 1024:.0f} MiB | command {cs[-1][0]:.2f} s "
              f"{cs[-1][1] / 1024:.0f} MiB (exit {cs[-1][2]}) | ratio {cs[-1][0] / ys[-1][0]:.2f} | load {loads[-1]:.2f}",
              flush=True)
    my, mc = statistics.median(t for t, _, _ in ys), statistics.median(t for t, _, _ in cs)
    ry, rc = max(r for _, r, _ in ys), max(r for _, r, _ in cs)
    ratios = sorted(c[0] / y[0] for c, y in zip(cs, ys))
    print(f"median wall: yardstick {my:.2f} s, command {mc:.2f} s; ratio of medians {mc / my:.2f}, "
          f"median of pair ratios {statistics.median(ratios):.2f}")
    print(f"peak RSS: yardstick {ry / 1024:.0f} MiB, command {rc / 1024:.0f} MiB; ratio {rc / ry:.2f}")
    print(f"load average (1 min) at the pairs' starts: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
