"""Human-readable units shared by the reports and the renderer (no torch, no Rich)."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB; '-' for None."""
    if n is None:
        return "-"
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:,.0f} {unit}" if unit == "B" else f"{sign}{n:,.1f} {unit}"
        n /= 1024
    return f"{sign}{n:,.1f} TiB"
