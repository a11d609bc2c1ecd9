"""autopipe/viz/predict.py: the timeline a plan predicts."""

from __future__ import annotations

import pytest

from autopipe.core.plan import Plan
from autopipe.viz.gantt import timeline_figure
from autopipe.viz.predict import predicted_timeline


def test_shared_device_timeline(gpipe_plan: Plan) -> None:
    shared = predicted_timeline(gpipe_plan, devices=["cpu"] * gpipe_plan.num_stages)
    # One device runs everything one task at a time: no overlap, no idle device time.
    spans = sorted((t.start_s, t.end_s) for t in shared.tasks)
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
    total = sum(s.time_s for s in gpipe_plan.stages) * gpipe_plan.microbatches
    assert shared.iteration_s == pytest.approx(total)
    assert shared.bubble_fraction == pytest.approx(0.0, abs=1e-9)
    assert shared.iteration_s > gpipe_plan.iteration_time_s
    assert "shared" in timeline_figure(shared).axes[0].get_title()


def test_stages_on_one_device_are_grouped_and_named(gpipe_plan: Plan) -> None:
    from autopipe.viz.predict import shared_groups

    assert shared_groups(["cpu", "cuda:1", "cpu", "cuda:1"]) == [[0, 2], [1, 3]]
    tl = predicted_timeline(gpipe_plan, devices=["cuda:0", "cuda:0", "cuda:1", "cuda:1"])
    assert tl.device_names == ["cuda:0", "cuda:1"] and tl.label == "predicted"
    assert {t.device for t in tl.tasks if t.stage < 2} == {0}
    assert {t.device for t in tl.tasks if t.stage >= 2} == {1}
    dedicated = predicted_timeline(gpipe_plan, label="plan")
    assert dedicated.label == "plan" and dedicated.schedule == gpipe_plan.schedule
    assert dedicated.iteration_s == pytest.approx(gpipe_plan.iteration_time_s, rel=1e-9)
    with pytest.raises(ValueError, match=r"^got 3 devices for a 4-stage plan; give one per stage$"):
        predicted_timeline(gpipe_plan, devices=["cpu"] * 3)
