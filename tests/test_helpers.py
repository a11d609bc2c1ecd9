"""The small helpers every layer shares: quantity formatting, the nearest-divisor hint and
lazily imported package attributes."""

from __future__ import annotations

import types

import pytest
from autopipe.planner.search import divisor_hint

from autopipe.core.humanize import format_bytes, format_seconds, parse_bytes
from autopipe.core.lazy import lazy_attributes


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


def test_divisor_hint_names_the_nearest_divisors() -> None:
    assert divisor_hint(32, 5) == "pick a divisor (e.g. 1, 2, 4, 8, 16, 32)"
    assert divisor_hint(360, 7, count=3) == "pick a divisor (e.g. 5, 6, 8)"  # ties: the smaller


def test_lazy_attributes_import_once_and_list_themselves() -> None:
    module = types.ModuleType("fake")
    module.__all__ = ["eager"]
    module.eager = 1
    getattr_, dir_ = lazy_attributes(
        "fake", {"join": "os.path", "sep": ("os", "sep")}, module.__dict__
    )
    module.__getattr__ = getattr_
    import os

    assert module.join is os.path.join and module.sep == os.sep
    assert module.__dict__["join"] is os.path.join  # kept: later lookups skip __getattr__
    assert dir_() == ["eager", "join", "sep"]
    with pytest.raises(AttributeError, match="module 'fake' has no attribute 'nope'"):
        module.nope  # noqa: B018
