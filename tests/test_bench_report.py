"""autopipe/bench_report.py: what a benchmark run measured, beside the prediction."""

from __future__ import annotations

import pytest

from autopipe.core.plan import Plan
from autopipe.core.timeline import Task, Timeline
from autopipe.viz.gantt import timeline_figure
from autopipe.viz.predict import predicted_timeline


def test_bench_titles_compare_like_with_like(gpipe_plan: Plan) -> None:
    """Before, the measured panel gave the drawn step's wall time (4.95 s) beside a 2.2 s
    prediction that the text, on thread-CPU time, found 0.4% off."""
    from dataclasses import replace

    from autopipe.bench_report import BenchResult
    from autopipe.core.humanize import format_seconds

    predicted = predicted_timeline(gpipe_plan, devices=["cpu"] * gpipe_plan.num_stages)
    wall = Timeline(
        [
            Task(t.stage, t.microbatch, t.phase, 2.25 * t.start_s, 2.25 * t.end_s, t.device)
            for t in predicted.tasks
        ],
        predicted.num_stages,
        label="measured (wall clock)",
        schedule=predicted.schedule,
        device_names=predicted.device_names,
    )
    result = BenchResult(
        plan=gpipe_plan,
        devices=["cpu"] * gpipe_plan.num_stages,
        steps=10,
        clock="thread_cpu",
        predicted=predicted,
        measured=wall,
        stages=[],
        iteration_predicted_s=predicted.iteration_s,
        iteration_measured_s=predicted.iteration_s / 0.996,
        iteration_wall_s=wall.iteration_s,
        step_measured_s=wall.iteration_s,
        loss_forward_s=0.0,
        loss_backward_s=0.0,
    )
    top, bottom = result.compare_titles()
    assert top == timeline_figure(predicted).axes[0].get_title()
    cpu = format_seconds(result.iteration_measured_s)
    assert f"iteration {cpu} CPU time (median of 10 steps; predicted -0.4%)" in bottom
    assert bottom.endswith(f"drawn on the wall clock: {format_seconds(wall.iteration_s)}")
    fig = timeline_figure(predicted, compare=wall, titles=(top, bottom))
    assert [ax.get_title() for ax in fig.axes[:2]] == [top, bottom]
    on_wall = replace(result, clock="wall", iteration_measured_s=wall.iteration_s)
    assert "wall clock (median of 10 steps; predicted -55.6%)" in on_wall.compare_titles()[1]


def test_measured_stage_times_are_medians_of_each_stages_tasks() -> None:
    from autopipe.bench_report import measured_stage_times

    tasks = [
        Task(0, 0, "forward", 0.0, 1.0, 0),
        Task(0, 1, "forward", 1.0, 4.0, 0),
        Task(0, 2, "forward", 4.0, 6.0, 0),
        Task(1, 0, "forward", 1.0, 2.0, 1),
        Task(1, 0, "backward", 2.0, 7.0, 1),
        Task(0, 0, "backward", 7.0, 9.0, 0),
    ]
    assert measured_stage_times(Timeline(tasks, 2)) == [(2.0, 2.0), (1.0, 5.0)]


def test_with_overhead_adds_to_a_copy(gpipe_plan: Plan) -> None:
    from autopipe.bench_report import with_overhead

    slower = with_overhead(gpipe_plan, 1e-3, 2e-3)
    for a, b in zip(gpipe_plan.stages, slower.stages, strict=True):
        assert b.forward_s == pytest.approx(a.forward_s + 1e-3)
        assert b.backward_s == pytest.approx(a.backward_s + 2e-3)
    assert slower.stages[0] is not gpipe_plan.stages[0]


def test_stage_errors_are_relative_to_the_measurement() -> None:
    from autopipe.bench_report import StageComparison

    s = StageComparison(0, "cpu", 1.1, 1.0, 1.8, 2.0)
    assert s.forward_error == pytest.approx(0.1) and s.backward_error == pytest.approx(-0.1)
    assert StageComparison(1, "cpu", 1.0, 0.0, 1.0, 1.0).forward_error == float("inf")
