"""What a rotary frequency table says: theta, the scaling (none, linear, llama-3, YaRN) and its factor, read from the
mean angle each pair advances per position (`scaling_reading`)."""

from __future__ import annotations

import math

import torch

# Frequencies, relative. Measured <= 1e-6 on HF's float32 tables; bugs: theta 10000 against 500000 moves every pair
# but the first by >= 40%, llama-3 scaling discarded moves the slow pairs 8x, frequencies over the wrong width >= 50%.
FREQ_TOL = 0.01
# Neighbouring frequency ratios equal to this (relative) are one geometric table: float32 tables <= 1e-6 apart; the
# llama-3 band changes a ratio by >= 10% at factor 8. A bfloat16 block holds its table rounded to 8 bits (inv_freq is
# cast with the module), each frequency off by up to 2^-9 (0.37% measured), a ratio of ratios by up to 2 finfo.eps:
# `ratio_tol` widens the tolerance to that where it is coarser.
RATIO_TOL = 1e-3
# The measured table's rotation error (radius and per-step wobble) times this bounds its frequency ratios' scatter:
# measured 3.1e-3 error against <= 3.0e-3 scatter for a bfloat16 table, 1.2e-6 against <= 1.4e-7 for a float32 one.
TABLE_WIDEN = 4
# The band's ramp fits a line (in the plain frequency: llama-3; in the pair index: YaRN) to this, in its share s of the
# plain frequency kept (0..1): HF tables <= 1e-7 on their own line; the other line misses by 0.05 (llama-3, 3 band
# pairs at 64 dims) and 0.30 (YaRN, 12).
RAMP_TOL = 1e-3


def ratio_tol(dtype: str, error: float = 0.0) -> float:
    """RATIO_TOL, or the resolution of the dtype the block runs in where that is coarser (bfloat16: 2 x 2^-7), or the
    table's own resolution where that is coarser still: a float32 block may keep its cos/sin in bfloat16 (modded-nanogpt
    does), which the float64 probe no longer shows but its rotation's wobble does (`rotary_reading`'s error: ~1e-6 for a
    float32 table, ~3e-3 for a bfloat16 one, whose frequency ratios then scatter by up to ~3e-3). That widening stops at
    a bfloat16 run's tolerance, far below a llama-3 band's >= 10%."""
    bf16 = 2 * torch.finfo(torch.bfloat16).eps
    return max(RATIO_TOL, 2 * torch.finfo(getattr(torch, dtype)).eps, min(TABLE_WIDEN * error, bf16))


def geometric_runs(ratios: list[float], tol: float) -> list[tuple[int, int]]:
    """The maximal runs of neighbouring frequency ratios equal within tol, as (first pair, last pair) of freqs."""
    runs, start = [], 0
    for k in range(1, len(ratios) + 1):
        if k == len(ratios) or abs(ratios[k] / ratios[start] - 1) > tol:
            runs.append((start, k))
            start = k
    return runs


def _log_line(freqs: list[float], start: int, end: int) -> tuple[float, float]:
    """log freq = b0 + b1 * pair, least squares over pairs start..end (b0 at pair 0)."""
    i = torch.arange(start, end + 1, dtype=torch.float64)
    logs = torch.tensor(freqs[start: end + 1], dtype=torch.float64).log()
    A = torch.stack((torch.ones_like(i), i), 1)
    b0, b1 = torch.linalg.lstsq(A, logs[:, None]).solution[:, 0].tolist()
    return b0, b1


def scaling_reading(freqs: list[float], dims: int, tol: float = RATIO_TOL) -> dict:
    """theta and the scaling a frequency table implies: none (theta^(-2i/dims)), linear (all divided by a factor), llama3
    (the fast pairs kept, the slow divided by a factor, a band between with 1/ratio linear in the frequency), yarn (that
    band linear in the pair index) or other."""
    m = len(freqs)
    if m < 2:
        return {"why": "one rotating pair: theta sets no frequency of it (theta^0)"}
    ratios = [b / a for a, b in zip(freqs, freqs[1:])]
    runs = geometric_runs(ratios, tol)
    lead = runs[0][1] - runs[0][0]
    b0, b1 = _log_line(freqs, *runs[0])
    # theta from the longest geometric run: YaRN's ramp may start at the second pair (a short original context at a
    # narrow head), and the slow pairs' run, each the plain frequency over the factor, has theta's ratio too
    start, end = max(runs, key=lambda r: r[1] - r[0])
    if end - start > lead:
        b1 = _log_line(freqs, start, end)[1]
    theta = math.exp(-b1 * dims / 2)
    top = math.exp(b0)
    if not theta > 1:  # the leading pairs do not slow down (a frequency repeated): no theta^(-2i/dims) table
        return {"theta": theta, "scaling": "other", "factor": None}
    if lead == len(ratios):  # one geometric table
        if abs(top - 1) <= FREQ_TOL:
            return {"theta": theta, "scaling": "none", "factor": 1.0}
        return {"theta": theta, "scaling": "linear", "factor": 1 / top}
    if abs(top - 1) > FREQ_TOL:
        return {"theta": theta, "scaling": "other", "factor": None}
    plain = [theta ** (-2 * k / dims) for k in range(m)]
    rho = [p / f for p, f in zip(plain, freqs)]
    factor = rho[-1]
    if factor <= 1 or any(b < a * (1 - tol) for a, b in zip(rho, rho[1:])):
        return {"theta": theta, "scaling": "other", "factor": None}
    band = [k for k, r in enumerate(rho) if 1 + tol < r < factor * (1 - tol)]
    kept = [k for k, r in enumerate(rho) if abs(r - 1) <= tol]
    slow = [k for k, r in enumerate(rho) if abs(r / factor - 1) <= tol]
    if len(kept) + len(slow) + len(band) != m:
        return {"theta": theta, "scaling": "other", "factor": None}
    kind, wavelens = "llama3", None
    if len(band) >= 2:  # the ramp's shape: llama-3's s is linear in the frequency, YaRN's in the pair index
        s = [(1 / rho[k] - 1 / factor) / (1 - 1 / factor) for k in band]
        w = [plain[k] for k in band]  # llama-3 ramps over the plain frequency
        lin = lambda xs: max(abs(v - (s[0] + (s[-1] - s[0]) * (x - xs[0]) / (xs[-1] - xs[0]))) for x, v in zip(xs, s))
        if len(band) >= 3:  # two points lie on either line: the shape is told from three
            by_freq, by_index = lin(w), lin([float(k) for k in band])
            ramp = max(RAMP_TOL, tol)
            kind = "llama3" if by_freq <= ramp else "yarn" if by_index <= ramp else "other"
        if kind == "llama3":  # s = 0 and s = 1 on that line: the wavelengths orig / low_freq and orig / high_freq
            a = (s[-1] - s[0]) / (w[-1] - w[0])
            b = s[0] - a * w[0]
            wavelens = (2 * math.pi * a / -b, 2 * math.pi * a / (1 - b))
    return {"theta": theta, "scaling": kind, "factor": factor, "wavelens": wavelens}
