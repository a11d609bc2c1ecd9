"""The per-cut fill/drain bound (planner/simulate.py ``fill_drain_lower_bound_s``) the
search uses to skip simulating cuts that cannot be faster: never above the simulator, by
hand, and why the textbook ``(M - 1) t_max + sum t_s`` could not be used."""

from __future__ import annotations

import pytest
from autopipe.planner.simulate import (
    ChunkWork,
    fill_drain_lower_bound_s,
    gpipe_closed_form,
    simulate_schedule,
)
from hypothesis import given, settings
from hypothesis import strategies as st

_seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)
_chunk = st.builds(
    ChunkWork,
    forward_s=_seconds,
    backward_s=_seconds,
    recompute_s=_seconds,
    send_s=_seconds,
    checkpoint=st.booleans(),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    chunks=st.lists(_chunk, min_size=1, max_size=8),
    microbatches=st.integers(min_value=1, max_value=12),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
)
def test_the_bound_is_never_above_the_simulator(
    chunks: list[ChunkWork], microbatches: int, schedule: str
) -> None:
    sim = simulate_schedule(chunks, schedule, len(chunks), microbatches, record_tasks=False)
    assert fill_drain_lower_bound_s(chunks, microbatches) <= sim.iteration_time_s


def test_the_bound_by_hand() -> None:
    # stage 1 is the bottleneck: P_1 = 1 + 0.5 (stage 0's forward and send), Q_1 = 2 + 0.25
    # (its recompute is not charged: not checkpointed), busy 4 x (2 + 0.5 + 3)
    chunks = [
        ChunkWork(forward_s=1.0, backward_s=2.0, send_s=0.5, recompute_s=0.25),
        ChunkWork(forward_s=2.0, backward_s=3.0, send_s=0.5),
        ChunkWork(forward_s=1.0, backward_s=1.0, send_s=9.0),  # the last stage sends nothing
    ]
    assert fill_drain_lower_bound_s(chunks, 4) == pytest.approx(1.5 + 4 * 5.5 + 2.0)
    sim = simulate_schedule(chunks, "1f1b", 3, 4, record_tasks=False)
    assert sim.iteration_time_s >= fill_drain_lower_bound_s(chunks, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_bottleneck_first_stage_hides_the_light_stages_after_it(schedule: str) -> None:
    # 1F1B: the light stage's fill and drain hide behind stage 0's warm-up forward, so the
    # step is M x t_0 = 8 s, below the textbook (M - 1) t_max + sum t_s = 8.02 s; the bound
    # stays below it
    chunks = [ChunkWork(forward_s=1.0, backward_s=1.0), ChunkWork(forward_s=0.01, backward_s=0.01)]
    sim = simulate_schedule(chunks, schedule, 2, 4, record_tasks=False)
    bound = fill_drain_lower_bound_s(chunks, 4)
    assert bound == pytest.approx(8.0)
    assert bound <= sim.iteration_time_s
    if schedule == "1f1b":
        assert sim.iteration_time_s == pytest.approx(8.0)
        assert gpipe_closed_form([2.0, 0.02], 4) == pytest.approx(8.02)
        assert gpipe_closed_form([2.0, 0.02], 4) > sim.iteration_time_s
