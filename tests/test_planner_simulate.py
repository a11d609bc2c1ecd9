"""The pipeline simulator against closed forms, and shared-device scheduling."""

from __future__ import annotations

import pytest
from autopipe.planner.simulate import gpipe_closed_form, gpipe_exact, simulate, stage_program
from hypothesis import given, settings
from hypothesis import strategies as st

times = st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(times, st.integers(1, 12), st.floats(1.0, 3.0))
def test_gpipe_matches_closed_form_without_send(fwd: list[float], m: int, ratio: float) -> None:
    bwd = [ratio * f for f in fwd]  # backward proportional to forward: one bottleneck stage
    sim = simulate(fwd, bwd, m)
    stage_times = [f + b for f, b in zip(fwd, bwd, strict=True)]
    assert sim.iteration_time_s == pytest.approx(gpipe_closed_form(stage_times, m), rel=1e-12)
    busy = m * sum(stage_times)
    assert sim.bubble_fraction == pytest.approx(
        1 - busy / (len(fwd) * sim.iteration_time_s), abs=1e-12
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data(), times, st.integers(1, 12))
def test_gpipe_matches_two_flow_shops_with_send_and_recompute(
    data, fwd: list[float], m: int
) -> None:
    k = len(fwd)
    bwd = data.draw(st.lists(st.floats(1e-4, 1.0), min_size=k, max_size=k))
    send = data.draw(st.lists(st.floats(0.0, 0.3), min_size=k, max_size=k))
    rec = data.draw(st.lists(st.sampled_from([0.0, 0.2]), min_size=k, max_size=k))
    sim = simulate(fwd, bwd, m, send_s=send, recompute_s=rec)
    send[-1] = 0.0
    expected = gpipe_exact(
        [f + s for f, s in zip(fwd, send, strict=True)],
        [b + r for b, r in zip(bwd, rec, strict=True)],
        m,
    )
    assert sim.iteration_time_s == pytest.approx(expected, rel=1e-12)
    # The textbook closed form never over-estimates the true fill-drain time.
    assert sim.iteration_time_s >= gpipe_closed_form(
        [f + b + s + r for f, b, s, r in zip(fwd, bwd, send, rec, strict=True)], m
    ) * (1 - 1e-12)


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_1f1b_same_time_as_gpipe_on_balanced_stages(k: int, m: int) -> None:
    fwd, bwd = [1.0] * k, [2.0] * k
    one = simulate(fwd, bwd, m, schedule="1f1b")
    gp = simulate(fwd, bwd, m, schedule="gpipe")
    assert one.iteration_time_s == pytest.approx((m + k - 1) * 3.0)
    assert gp.iteration_time_s == pytest.approx(one.iteration_time_s)
    assert one.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))


def test_1f1b_program_bounds_in_flight() -> None:
    k, m = 4, 10
    for s in range(k):
        prog = stage_program(s, k, m, "1f1b")
        assert sorted(prog) == sorted(stage_program(s, k, m, "gpipe"))
        in_flight = peak = 0
        for action in prog:
            assert action.stage == s
            in_flight += 1 if action.phase == "forward" else -1
            peak = max(peak, in_flight)
        assert peak == min(k - s, m)


def test_tasks_form_a_valid_gantt() -> None:
    sim = simulate(
        [1.0, 2.0, 1.5], [2.0, 3.0, 2.5], 4, send_s=[0.5, 0.25, 0.0], recompute_s=[1.0, 0, 0]
    )
    phases = {t.phase for t in sim.tasks}
    assert phases == {"forward", "backward", "send", "recompute"}
    by_stage: dict[int, list] = {}
    for t in sim.tasks:
        by_stage.setdefault(t.stage, []).append(t)
    for tasks in by_stage.values():  # one task at a time per device
        tasks.sort(key=lambda t: t.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(tasks, tasks[1:], strict=False))
    end = {(t.stage, t.microbatch, t.phase): t.end_s for t in sim.tasks}
    start = {(t.stage, t.microbatch, t.phase): t.start_s for t in sim.tasks}
    for m in range(4):  # data dependencies
        assert start[(1, m, "forward")] >= end[(0, m, "send")]
        assert start[(0, m, "recompute")] >= end[(1, m, "backward")]
    assert max(t.end_s for t in sim.tasks) == sim.iteration_time_s


def test_shared_device_runs_one_task_at_a_time() -> None:
    fwd, bwd = [1.0, 2.0, 1.0], [2.0, 4.0, 2.0]
    sim = simulate(fwd, bwd, 4, shared_device_groups=[[0, 1, 2]])
    assert sim.iteration_time_s == pytest.approx(4 * (4 + 8))  # all work serialised, no idle
    assert sim.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    tasks = sorted(sim.tasks, key=lambda t: t.start_s)
    assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(tasks, tasks[1:], strict=False))
    assert {t.device for t in tasks} == {0}
    # Two stages share one device, a third has its own: slower than dedicated, faster than serial.
    part = simulate(fwd, bwd, 4, shared_device_groups=[[0, 1]])
    alone = simulate(fwd, bwd, 4)
    assert alone.iteration_time_s < part.iteration_time_s < sim.iteration_time_s
    with pytest.raises(ValueError):
        simulate(fwd, bwd, 2, shared_device_groups=[[0], [0]])


def test_1f1b_tasks_keep_in_flight_bounded_with_send_and_recompute() -> None:
    k, m = 4, 9
    sim = simulate(
        [1.0, 1.5, 0.5, 1.0],
        [2.0, 2.5, 1.0, 2.5],
        m,
        send_s=[0.2, 0.1, 0.3, 0.0],
        recompute_s=[1.0, 0.0, 0.5, 0.0],
        schedule="1f1b",
    )
    for s in range(k):
        events = sorted(
            (t.end_s if t.phase == "forward" else t.start_s, 1 if t.phase == "forward" else -1)
            for t in sim.tasks
            if t.stage == s and t.phase in ("forward", "backward")
        )
        level = peak = 0
        for _, step in events:
            level += step
            peak = max(peak, level)
        assert peak <= min(k - s, m)


def test_simulate_plan_matches_planner_prediction() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from autopipe.planner import plan, simulate_plan
    from planner_instances import random_profile

    from autopipe.core.request import PlanRequest

    for schedule in ("gpipe", "1f1b"):
        p = plan(
            random_profile(12, 3),
            PlanRequest(gpus=4, microbatches=8, schedule=schedule, checkpoint="always"),
        )
        sim = simulate_plan(p)
        assert sim.iteration_time_s == pytest.approx(p.iteration_time_s, rel=1e-12)
        assert sim.bubble_fraction == pytest.approx(p.bubble_fraction, rel=1e-9)
