"""autopipe/viz/scaling.py: throughput over the GPU count."""

from __future__ import annotations

from pathlib import Path

import pytest
from autopipe.planner import plan
from viz_plans import (
    _check_png,
)

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.viz.data import scaling_data


def test_scaling_plot(gpipe_plan: Plan, profile: Profile, tmp_path: Path) -> None:
    from autopipe.viz.scaling import plot_scaling

    data = scaling_data(gpipe_plan, profile, max_gpus=6)
    ks = [p["num_stages"] for p in data["points"]]
    assert ks == [1, 2, 3, 4, 5, 6]
    one = plan(
        profile, PlanRequest(gpus=1, batch_size=32, memory_per_device=2**30, baselines=False)
    )
    assert data["points"][0]["throughput"] == pytest.approx(one.throughput)
    _check_png(plot_scaling(data, tmp_path / "scaling")[0])
