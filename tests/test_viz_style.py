"""autopipe/viz/style.py: units and looks shared by the figures."""

from __future__ import annotations


def test_byte_units_follow_the_data() -> None:
    from autopipe.viz.style import byte_unit

    assert byte_unit(44.3 * 2**20) == ("MiB", 2**20)
    assert byte_unit(80e9) == ("GiB", 2**30)
    assert byte_unit(512) == ("B", 1) and byte_unit(3 * 2**10) == ("KiB", 2**10)
