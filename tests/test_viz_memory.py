"""autopipe/viz/memory.py: memory over time per rank, in the titles' unit."""

from __future__ import annotations

import pytest
from viz_plans import (
    _gpt_like_plan,
    _profile,
)

from autopipe.core.request import PlanRequest


def test_memory_axes_read_in_the_titles_unit() -> None:
    """Before, the memory of a plan of a few MiB per rank was drawn on a "GiB" axis with
    ticks at 0.025 under titles in MiB."""
    from autopipe.viz.memory import plan_memory_figure

    p = _gpt_like_plan(16)
    fig = plan_memory_figure(p)
    for ax in fig.axes:
        unit = ax.get_title(loc="left").split()[-1]  # "rank 0: peak 44.3 MiB"
        assert unit == "MiB" and ax.get_ylabel() == "MiB"
        peak = float(ax.get_title(loc="left").split()[-2])
        low, high = ax.get_ylim()
        assert low == 0 and 1.05 * peak <= high <= 1.1 * peak  # the peak clears the frame
        (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "memory"]
        assert max(line.get_ydata()) == pytest.approx(peak, rel=1e-3)


def test_schedules_memory_legend_sits_below_the_panels() -> None:
    """Before, the rank legend sat inside the first panel, over its lines (zbv's, there)."""
    from autopipe.planner import plan_each_schedule

    from autopipe.viz.memory import schedules_figure

    plans = plan_each_schedule(_profile(), PlanRequest(gpus=4, microbatches=8))
    _, mem = schedules_figure(plans)
    assert all(ax.get_legend() is None for ax in mem.axes)
    (legend,) = mem.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"rank {r}" for r in range(4)]
    for ax in mem.axes:
        unit = ax.get_title(loc="left").split()[-1]  # "... peak 67.5 MiB"
        assert ax.get_ylabel() == unit == "MiB"
        drawn = max(max(ln.get_ydata()) for ln in ax.get_lines() if ln.get_gid() == "memory")
        assert ax.get_ylim()[1] >= 1.05 * drawn
