"""Quantities for humans (``autopipe.core.humanize``), which every layer's messages use."""

from __future__ import annotations

import pytest

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


def test_parse_bandwidth_tells_bits_from_bytes() -> None:
    """Before, the size parser lower-cased the unit: ``400Gb`` (bits) read as 400 GB/s, 8x."""
    from autopipe.core.humanize import parse_bandwidth

    for text in ("400Gb", "400Gbit", "400Gb/s", "400Gbit/s", "400Gbps"):
        assert parse_bandwidth(text) == 50e9, text
    for text in ("50GB", "50GB/s", "50GBps", " 50 GB/s ", "5e10", "5e10/s"):
        assert parse_bandwidth(text) == 50e9, text
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_bandwidth("8Kbit") == 1000


def test_parse_bandwidth_refuses_an_ambiguous_unit_in_one_line() -> None:
    from autopipe.core.humanize import parse_bandwidth

    for text in ("50gb", "50gbps", "50G", "50kb", "50Gb/ms", "inf", "0.5", "1e400"):
        with pytest.raises(ValueError) as info:
            parse_bandwidth(text)
        assert "\n" not in str(info.value) and "memory size" not in str(info.value)
    with pytest.raises(ValueError, match="ambiguous or unknown bandwidth unit 'gb'"):
        parse_bandwidth("400gb")
