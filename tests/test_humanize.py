"""Quantities for humans (``autopipe.core.humanize``), which every layer's messages use."""

from __future__ import annotations

from autopipe.core.humanize import format_bytes


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
