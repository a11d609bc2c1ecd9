"""Parsing and printing of bytes and seconds for humans (CLI flags, tables)."""

from __future__ import annotations

import math
import re

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
MAX_BYTES = 2**60
"""The largest size a flag takes (1 EiB, far beyond any device); more is a typo."""


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920, ``"80GB"``/``"80G"`` -> 80e9, ``"1.5e9"`` -> 1500000000.

    Raises ValueError with the accepted forms on anything else: sizes under one byte
    (``0.5`` would silently become 0), and sizes too large to be finite (``1e400``).
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 80GiB, 40GB, 16e9)")
    value = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"memory size {text!r} is too large; give at most 1 EiB (e.g. 80GiB)")
    if value < 1:
        raise ValueError(f"memory size {text!r} is less than one byte; give e.g. 512MiB")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units, three significant digits: ``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return (
                f"{n:.0f} {unit}"
                if unit == "B"
                else f"{n:.3g} {unit}"
                if n >= 100
                else f"{n:.2f} {unit}"
            )
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """``0.0123 -> "12.3 ms"``, ``5.0 -> "5 s"``, ``1234.5 -> "1234 s"``; picks s / ms / us."""
    if s >= 1:
        return f"{_three_digits(s)} s"
    if s >= 1e-3:
        return f"{_three_digits(s * 1e3)} ms"
    return f"{_three_digits(s * 1e6)} us"


def _three_digits(x: float) -> str:
    # .3g switches to an exponent (1e+03) once x rounds to 1000; whole numbers read better.
    return f"{x:.0f}" if x >= 999.5 else f"{x:.3g}"
