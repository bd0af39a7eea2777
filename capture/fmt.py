"""One way to show figures to people: bytes, durations and numbers.

Every report, table and message formats through here, so a figure reads the same everywhere
(``12.34 GiB`` in the report and in ``capture show``). Unknown values show as ``-``.
"""

from __future__ import annotations

MISSING = "-"


def bytes_str(n: int | float | None) -> str:
    """Binary units, as the cards' capacities are quoted by the tools: ``47.13 GiB``, ``512 B``."""
    if n is None:
        return MISSING
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def seconds_str(s: float | None) -> str:
    """``250.6 ms``, ``18.60 s``, ``4.0 min``, ``2.10 h``."""
    if s is None:
        return MISSING
    if s == 0:
        return "0 s"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if abs(s) < 1:
        return f"{s * 1e3:.1f} ms"
    if abs(s) < 120:
        return f"{s:.2f} s"
    if abs(s) < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def number_str(v: float | int | None, digits: int = 3) -> str:
    """A figure for people: ``64,113``, ``0.256``, ``0.332``."""
    if v is None:
        return MISSING
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def percent_str(fraction: float | None, digits: int = 1) -> str:
    """``0.338`` → ``33.8 %``."""
    if fraction is None:
        return MISSING
    return f"{fraction * 100:.{digits}f} %"


def flops_str(v: float, per_s: bool = False) -> str:
    """``32.37 GFLOP``, ``989 TFLOP/s`` (decimal units, as the cards' peaks are quoted)."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(v) >= size:
            return f"{v / size:.4g} {unit}" + ("/s" if per_s else "")
    return f"{v:.4g} FLOP" + ("/s" if per_s else "")
