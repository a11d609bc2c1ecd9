"""Shared look of autopipe's figures: colours per phase, headless backend, saving."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PHASE_COLORS = {
    "forward": "#4C72B0",
    "recompute": "#55A868",
    "backward": "#DD8452",
    # A split backward in two shades of the whole one's orange: inputs' gradient, weights'.
    "backward_input": "#C44E52",
    "backward_weight": "#E8A87C",
    "send": "#8172B3",
    "loss": "#937860",
}
"""A colour for each of ``autopipe.core.timeline.PHASES``."""
MEMORY_COLORS = {
    # A palette apart from the phases', so one legend can hold both.
    "parameters": "#2A9D8F",
    "gradients + optimizer": "#8D99AE",
    "activations": "#E9C46A",
}
BUBBLE_COLOR = "#D9D9D9"
FORMATS = ("png", "svg")
HEADROOM = 1.08
"""Top of a bar or line chart's y axis over its tallest value: the tallest bar clears the
frame."""

_BYTE_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def byte_unit(largest_bytes: float) -> tuple[str, int]:
    """The binary unit (name, bytes) to draw sizes up to ``largest_bytes`` in: the largest
    unit in which that size is at least 1, as ``format_bytes`` prints it in titles, so an
    axis reads "MiB" where the title says "44.3 MiB" (not "GiB" ticks at 0.025)."""
    name, size = _BYTE_UNITS[0]
    for unit_name, unit in _BYTE_UNITS:
        if largest_bytes >= unit:
            name, size = unit_name, unit
    return name, size


def new_figure(width_in: float, height_in: float) -> Figure:
    """A figure on the Agg canvas (never a GUI window, works without a display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out: str | Path, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Write ``fig`` as ``out.<fmt>`` for each format; ``out`` has no suffix. Returns the paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unsupported plot format {fmt!r}; use one of {', '.join(FORMATS)}")
        path = out.with_name(f"{out.name}.{fmt}")
        fig.savefig(path, format=fmt, dpi=120)
        paths.append(path)
    return paths
