"""The fill-drain clock cycles (``autopipe.runtime.schedule``)."""

from __future__ import annotations

import pytest
from autopipe.planner.simulate import fill_drain_bubble
from autopipe.runtime.schedule import clock_cycles


@pytest.mark.parametrize(("m", "k"), [(1, 1), (4, 3), (3, 5), (7, 2)])
def test_clock_cycles_respect_dependencies(m: int, k: int) -> None:
    clocks = list(clock_cycles(m, k))
    assert len(clocks) == m + k - 1
    when = {task: c for c, tasks in enumerate(clocks) for task in tasks}
    assert sorted(when) == [(i, j) for i in range(m) for j in range(k)]
    for (i, j), c in when.items():
        assert c == i + j
        if j > 0:
            assert when[(i, j - 1)] < c
        if i > 0:
            assert when[(i - 1, j)] < c  # a stage takes micro-batches in order
    assert fill_drain_bubble(m, k) == pytest.approx((k - 1) / (m + k - 1))
