"""planner/assemble.py: the chosen candidate written out as a Plan, its figures consistent."""

from __future__ import annotations

import pytest
from autopipe.planner import Cluster, plan
from autopipe.planner.assemble import simulate_costs
from autopipe.planner.simulate import simulate
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import cost_model, random_profile

from autopipe.core.request import PlanRequest


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(2, 8), st.integers(1, 4), st.sampled_from([1, 2, 8]), st.integers(0, 10_000))
def test_gpipes_formula_equals_the_event_simulator(n: int, k: int, m: int, seed: int) -> None:
    k = min(k, n)
    cluster = Cluster.homogeneous(k, link_bandwidth_bytes_per_s=1e9)
    cm = cost_model(random_profile(n, seed), cluster, m, "gpipe", "always")
    costs = cm.stage_costs([round(i * n / k) for i in range(k + 1)])
    exact = simulate_costs(costs, m, "gpipe")
    events = simulate(
        [c.forward_s for c in costs],
        [c.backward_s for c in costs],
        m,
        recompute_s=[c.recompute_s for c in costs],
        send_s=[c.send_s for c in costs],
        schedule="gpipe",
        record_tasks=False,
    )
    assert exact.iteration_time_s == pytest.approx(events.iteration_time_s, rel=1e-9)
    assert exact.bubble_fraction == pytest.approx(events.bubble_fraction, rel=1e-9, abs=1e-12)


def test_the_plans_figures_agree_with_each_other() -> None:
    profile = random_profile(12, 5)
    p = plan(profile, PlanRequest(gpus=4, batch_size=64, microbatches=(4, 8), schedule="1f1b"))
    assert [u for s in p.stages for u in s.units] == profile.unit_names
    assert [s.unit_parameters for s in p.stages] == [
        [u.parameter_count for u in profile.units[a : a + len(s.units)]]
        for s, a in zip(p.stages, p.boundaries, strict=True)
    ]
    assert p.microbatch_size * p.microbatches == p.batch_size == 64
    assert p.throughput == pytest.approx(64 / p.iteration_time_s)
    assert p.speedup == pytest.approx(p.single_device_time_s / p.iteration_time_s)
    times = [s.time_s for s in p.stages]
    assert p.bottleneck_stage == times.index(max(times))
    assert p.bottleneck_s == pytest.approx(max(times))
    assert p.min_bottleneck_s <= p.bottleneck_s
    assert 0 < p.lower_bound_s <= p.iteration_time_s
    assert p.lower_bound_gap == pytest.approx(p.iteration_time_s / p.lower_bound_s - 1)
    assert len(p.rank_peak_bytes) == 4 and p.memory_per_device is None
    assert any(r.feasible and r.schedule == p.schedule for r in p.candidates)
    assert p.strategy == "dp" and p.baselines


def test_hand_written_profiles_without_counts_record_none() -> None:
    profile = random_profile(4, 2)
    profile.units[1].parameter_count = 0  # bytes but no count: a hand-written profile
    p = plan(profile, PlanRequest(gpus=2, microbatches=2, baselines=False))
    assert all(s.unit_parameters == [] for s in p.stages) and p.baselines == {}
