"""autopipe/viz/style.py: units and looks shared by the figures."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_byte_units_follow_the_data() -> None:
    from autopipe.viz.style import byte_unit

    assert byte_unit(44.3 * 2**20) == ("MiB", 2**20)
    assert byte_unit(80e9) == ("GiB", 2**30)
    assert byte_unit(512) == ("B", 1) and byte_unit(3 * 2**10) == ("KiB", 2**10)


def test_every_phase_has_a_colour() -> None:
    from autopipe.core.timeline import PHASES
    from autopipe.viz.style import PHASE_COLORS

    assert set(PHASES) <= set(PHASE_COLORS)


def test_save_writes_each_format_and_refuses_others(tmp_path: Path) -> None:
    from autopipe.viz.style import new_figure, save

    fig = new_figure(2, 1)
    fig.add_subplot().plot([0, 1], [1, 0])
    paths = save(fig, tmp_path / "sub" / "fig", formats=("png", "svg"))
    assert [p.name for p in paths] == ["fig.png", "fig.svg"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in paths[1].read_text()
    with pytest.raises(ValueError, match=r"^unsupported plot format 'pdf'; use one of png, svg$"):
        save(fig, tmp_path / "fig", formats=("pdf",))
