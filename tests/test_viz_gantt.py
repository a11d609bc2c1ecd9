"""autopipe/viz/gantt.py: the timeline (Gantt) figure: boxes, bubbles, labels, axes."""

from __future__ import annotations

from pathlib import Path

import pytest
from autopipe.planner.simulate import fill_drain_bubble
from viz_plans import (
    _check_png,
    _drawn_idle_fraction,
    _gpt_like_plan,
)

from autopipe.core.plan import Plan
from autopipe.core.timeline import Task, Timeline
from autopipe.viz.gantt import plot_timeline, timeline_figure
from autopipe.viz.predict import predicted_timeline


@pytest.mark.parametrize("which", ["gpipe_plan", "onefoneb_plan"])
def test_timeline_idle_area_matches_plan_bubble(which: str, request, tmp_path: Path) -> None:
    p: Plan = request.getfixturevalue(which)
    tl = predicted_timeline(p)
    assert tl.iteration_s == pytest.approx(p.iteration_time_s, rel=1e-9)
    fig = timeline_figure(tl)
    ax = fig.axes[0]
    assert abs(_drawn_idle_fraction(ax) - p.bubble_fraction) < 0.01
    phases = {str(x.get_gid()) for x in ax.patches}
    if p.schedule == "1f1b":
        assert {"task:forward", "task:backward", "task:recompute", "task:send"} <= phases
    # Micro-batch numbers are written in the boxes where they fit.
    assert any(t.get_text() == "0" for t in ax.texts)
    assert f"bubble {100 * p.bubble_fraction:.1f}%" in ax.get_title()
    paths = plot_timeline(tl, tmp_path / "timeline", formats=("png", "svg"))
    _check_png(paths[0])
    assert paths[1].read_text().lstrip().startswith("<?xml")


def test_gpipe_bubble_equals_closed_form_for_equal_stages(tmp_path: Path) -> None:
    k, m = 4, 8
    # Equal stages: the simulator's fill-drain bubble is exactly (K-1)/(M+K-1).
    from autopipe.planner.simulate import simulate

    sim = simulate([1.0] * k, [2.0] * k, m)
    tl = sim.timeline
    assert isinstance(tl, Timeline) and tl.num_stages == k
    assert tl.bubble_fraction == pytest.approx(fill_drain_bubble(m, k))
    ax = timeline_figure(tl).axes[0]
    assert _drawn_idle_fraction(ax) == pytest.approx(fill_drain_bubble(m, k), abs=1e-9)


def test_compare_shares_time_axis(gpipe_plan: Plan, tmp_path: Path) -> None:
    predicted = predicted_timeline(gpipe_plan)
    # A "measured" run 30% slower than predicted.
    measured = Timeline(
        [
            Task(t.stage, t.microbatch, t.phase, 1.3 * t.start_s, 1.3 * t.end_s, t.device)
            for t in predicted.tasks
        ],
        predicted.num_stages,
        label="measured",
    )
    fig = timeline_figure(predicted, compare=measured)
    top, bottom = fig.axes[:2]
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_xlim() == bottom.get_xlim()
    assert top.get_xlim()[1] == pytest.approx(1.3 * predicted.iteration_s * 1e3)
    assert "measured" in bottom.get_title()
    _check_png(plot_timeline(predicted, tmp_path / "cmp", compare=measured)[0], min_h=400)


def test_every_microbatch_is_labelled_on_the_timeline() -> None:
    """Before, the labels of an 8-stage plan at M=16 stopped at micro-batch 9: two digits
    were taken to need 18 px, and the boxes had 16."""
    p = _gpt_like_plan(16)
    timeline = predicted_timeline(p)
    ax = timeline_figure(timeline).axes[0]
    labels = [t.get_text() for t in ax.texts if t.get_gid() == "label"]
    assert len(labels) == len(timeline.tasks) == 2 * 8 * 16
    assert sorted(set(labels), key=int) == [str(m) for m in range(16)]
    assert {t.get_fontsize() for t in ax.texts} == {7.0}


def test_narrow_boxes_get_a_wider_figure_and_smaller_labels() -> None:
    """At M=32 the first stage's forwards are too narrow for two digits at 7 pt even 16 in
    wide: the figure takes the widest, and every box that holds two digits at 5 pt is
    labelled, in one size per row and phase where one fits them all."""
    from autopipe.viz.gantt import LABEL_SIZES_PT, WIDTH_IN, label_width_px

    timeline = predicted_timeline(_gpt_like_plan(32))
    fig = timeline_figure(timeline)
    ax = fig.axes[0]
    assert fig.get_figwidth() == WIDTH_IN[1]
    px_per_s = 0.85 * WIDTH_IN[1] * fig.dpi / timeline.iteration_s
    wide = [t for t in timeline.tasks if t.duration_s * px_per_s >= label_width_px("00", 5, 100)]
    labels = [t for t in ax.texts if t.get_gid() == "label"]
    assert len(labels) >= len(wide) > len(timeline.tasks) // 2
    assert {t.get_fontsize() for t in labels} <= set(LABEL_SIZES_PT)


def test_labels_shrink_before_they_go() -> None:
    from autopipe.viz.gantt import LABEL_SIZES_PT, box_label_size, label_size, label_width_px

    assert label_size([(20.0, "15")], 100.0) == LABEL_SIZES_PT[0]
    narrow = label_width_px("15", LABEL_SIZES_PT[-1], 100.0)
    # One size for the chart while one fits every box; else each box its own.
    assert label_size([(20.0, "15"), (narrow, "15")], 100.0) == LABEL_SIZES_PT[-1]
    assert label_size([(20.0, "15"), (narrow - 1, "15")], 100.0) is None
    assert box_label_size(20.0, "15", 100.0) == LABEL_SIZES_PT[0]
    assert box_label_size(narrow - 1, "15", 100.0) is None  # unlabelled
