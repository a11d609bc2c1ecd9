"""Pricing an analytic profile's stored cost parts (autopipe.profiler.calibrate): the time
model over micro-batch sizes, the B/W split by FLOPs; on hand-made parts."""

from __future__ import annotations

import pytest
from autopipe.profiler.calibrate import priced_times, weight_flops_share

from autopipe.core.profile_records import Counting


def part(
    compute_s: float,
    memory_s: float,
    kernels: int,
    flops: float = 0.0,
    parameter_flops: float = 0.0,
) -> dict:
    phase = {"compute_s": compute_s, "memory_s": memory_s, "kernels": kernels, "flops": flops}
    return {"forward": {**phase, "parameter_flops": parameter_flops}, "backward": dict(phase)}


def test_times_are_the_scaled_parts_plus_launches() -> None:
    counting = Counting(units=[part(2e-3, 1e-3, 10)], loss=part(0.0, 5e-4, 2))
    times = priced_times(counting, 8, compute_scale=2.0, memory_scale=0.5, launch_s=1e-5)
    # 2 ms x 2 + 1 ms x 0.5 + 10 launches x 10 us
    assert times["forward_s"] == pytest.approx([4e-3 + 0.5e-3 + 1e-4])
    assert times["backward_s"] == times["forward_s"]
    # One size only: the per-call part is the launches.
    assert times["forward_overhead_s"] == pytest.approx([1e-4])
    assert times["loss_forward_s"] == pytest.approx(0.25e-3 + 2e-5)


def test_overhead_is_the_intercept_of_the_time_model_over_sizes() -> None:
    """Counted at b = 8 and b = 2: t(8) = 1 + 8 ms, t(2) = 1 + 2 ms: the intercept is 1 ms."""
    counting = Counting(
        units=[part(8e-3, 1e-3, 0)],
        smaller_sizes=[{"microbatch_size": 2, "units": [part(2e-3, 1e-3, 0)]}],
    )
    times = priced_times(counting, 8, 1.0, 1.0, launch_s=0.0)
    assert times["forward_s"] == pytest.approx([9e-3])
    assert times["forward_overhead_s"] == pytest.approx([1e-3])
    assert times["loss_forward_s"] == 0.0


def test_weight_share_of_the_backward_by_flops() -> None:
    assert weight_flops_share(part(0, 0, 0, flops=300.0, parameter_flops=100.0)) == pytest.approx(
        1 / 3
    )
    assert weight_flops_share(part(0, 0, 0, flops=0.0, parameter_flops=100.0)) == 0.0
    assert weight_flops_share(part(0, 0, 0, flops=50.0, parameter_flops=100.0)) == 1.0
