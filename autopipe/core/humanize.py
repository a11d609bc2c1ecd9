"""Quantities for humans: parsing sizes and bandwidths from flags, printing bytes and seconds.

The one owner of byte and time formatting for every layer (tables, explanations, the
planner's error messages, plot titles). Imports nothing from autopipe and no torch, so the
torch-free planner may use it.
"""

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


_PREFIXES = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip
_RATE_UNITS: dict[str, float] = {}
for _prefix, _factor in _PREFIXES.items():
    if _prefix != "k":  # "kB" is fine, but "kb" is read as kilobytes as often as kilobits
        _RATE_UNITS[f"{_prefix}b"] = _factor / 8
    _RATE_UNITS[f"{_prefix}bit"] = _factor / 8
    _RATE_UNITS[f"{_prefix}B"] = _factor
del _prefix, _factor


def parse_bandwidth(text: str) -> float:
    """A bandwidth in bytes per second from a flag or a device-spec file: bytes (``50GB``,
    ``50GB/s``, ``46.6GiB/s``, ``50GBps``) or bits (``400Gb``, ``400Gbit/s``, ``400Gbps``),
    the case of the unit deciding (B: byte, b or bit: bit); a plain number is bytes/s
    (``5e10``). ``parse_bandwidth("400Gb") == 50e9``.

    Raises ValueError in one line on anything else: a unit whose case leaves bits and bytes
    open (``gb``, ``50G``) is refused, never guessed; so are rates under one byte/s or over
    1 EiB/s and non-finite ones.
    """
    match = re.fullmatch(
        r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*?)(/s|ps)?\s*", text
    )
    if not match:
        raise ValueError(
            f"not a bandwidth: {text!r} (examples: 50GB/s or 50GB for bytes per second, "
            "400Gb/s or 400Gbit for bits per second, 5e10)"
        )
    number, unit = match.group(1), match.group(2)
    if unit not in _RATE_UNITS and not (unit == "" and match.group(3) != "ps"):
        raise ValueError(
            f"ambiguous or unknown bandwidth unit {unit + (match.group(3) or '')!r} in "
            f"{text!r}: write B for bytes or b/bit for bits, e.g. 50GB/s (bytes) or "
            "400Gb/s (bits)"
        )
    value = float(number) * _RATE_UNITS.get(unit, 1)
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"bandwidth {text!r} is too large; give at most 1 EiB/s (e.g. 50GB/s)")
    if value < 1:
        raise ValueError(f"bandwidth {text!r} is under one byte per second; give e.g. 50GB/s")
    return value


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float, *, fixed: bool = False) -> str:
    """``n`` bytes in the largest binary unit (B ... TiB) that keeps the number under 1024;
    whole bytes under 1 KiB, so a small size never reads "0.0 MiB".

    Default (tables): three significant digits, ``format_bytes(3 * 2**30) == "3.00 GiB"``,
    ``"12.3 MiB"``, ``"512 MiB"``. ``fixed`` (messages that compare sizes): two decimals from
    1 GiB up and one below, ``"79.95 GiB"``, ``"1.0 KiB"``, so that a need and a capacity a
    few MiB apart print differently.
    """
    value = float(n)
    exponent = 0
    while abs(value) >= 1024 and exponent < len(_BINARY_UNITS) - 1:
        value /= 1024
        exponent += 1
    unit = _BINARY_UNITS[exponent]
    if exponent == 0:
        return f"{value:.0f} {unit}"
    if fixed:
        return f"{value:.{2 if exponent >= 3 else 1}f} {unit}"
    return f"{value:.3g} {unit}" if value >= 100 else f"{value:.2f} {unit}"


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


def printable(name: str) -> str:
    """``name`` (a unit or module name from a model or a file) safe to print on a terminal:
    every non-printable character (control codes such as ESC or a newline, other invisible
    separators) as its ``repr`` escape (``\\x1b``, ``\\n``), all else as itself, no quotes
    added. ``printable("a\\x1b[31mb") == "a\\\\x1b[31mb"``. O(len(name))."""
    if name.isprintable():
        return name
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in name)
