"""autopipe/viz/bubble.py: the bubble-vs-M figure and its data."""

from __future__ import annotations

from pathlib import Path

import pytest
from viz_plans import (
    _check_png,
)

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.viz.data import bubble_data


def test_bubble_plot_data_and_image(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.bubble import bubble_figure, plot_bubble

    data = bubble_data(gpipe_plan, profile, ks=[2, 4])
    k4 = next(c for c in data["curves"] if c["num_stages"] == 4)
    chosen = next(p for p in k4["points"] if p["microbatches"] == gpipe_plan.microbatches)
    assert chosen["bubble_fraction"] == pytest.approx(gpipe_plan.bubble_fraction)
    # M was chosen automatically, so no other M of the same K is faster.
    best = max(p["throughput"] for p in k4["points"] if p["feasible"])
    assert chosen["throughput"] == pytest.approx(best)
    assert [p["microbatches"] for p in k4["points"]] == [1, 2, 4, 8, 16, 32]
    fig = bubble_figure(data)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    stars = [ln for ax_ in fig.axes for ln in ax_.get_lines() if ln.get_marker() == "*"]
    assert stars and all(ln.get_xdata()[0] == gpipe_plan.microbatches for ln in stars)
    rule = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [16, 16]]
    assert rule, "GPipe's M >= 4K line is drawn at M = 16 for K = 4"
    _check_png(plot_bubble(data, tmp_path / "bubble")[0])
