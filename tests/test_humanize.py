"""Quantities for humans (``autopipe.core.humanize``), which every layer's messages use."""

from __future__ import annotations

from autopipe.core.humanize import format_bytes, format_seconds, parse_bytes


def test_format_bytes_for_tables_and_for_messages() -> None:
    assert [format_bytes(n) for n in (512, 3 * 2**30, 12.3 * 2**20, 512 * 2**20)] == [
        "512 B",
        "3.00 GiB",
        "12.30 MiB",
        "512 MiB",
    ]
    # Messages that compare a need with a capacity: fixed decimals, never "0.0 MiB".
    assert [format_bytes(n, fixed=True) for n in (512, 1024, 12.34 * 2**20, 79.951 * 2**30)] == [
        "512 B",
        "1.0 KiB",
        "12.3 MiB",
        "79.95 GiB",
    ]
    assert format_bytes(3 * 2**40) == format_bytes(3 * 2**40, fixed=True) == "3.00 TiB"


def test_units_is_an_alias_of_humanize() -> None:
    import autopipe.core.humanize as units

    assert units.format_bytes is format_bytes and units.format_seconds is format_seconds
    assert units.parse_bytes is parse_bytes
