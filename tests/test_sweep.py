"""planner/sweep.py: the GPU-count and schedule sweeps."""

from __future__ import annotations

import pytest
from autopipe.planner import Cluster, Device, PlanningError, min_gpus, plan, scaling_report
from autopipe.planner.sweep import plan_each_schedule
from planner_instances import random_profile

from autopipe.core.plan import Plan
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import PLAN_SCHEDULES


def test_scaling_report_and_min_gpus() -> None:
    profile = random_profile(16, 6)
    mem = 6 * 10**8
    k = min_gpus(profile, request=PlanRequest(memory_per_device=mem, microbatches=4))
    with pytest.raises(PlanningError):
        plan(profile, PlanRequest(gpus=k - 1, memory_per_device=mem, microbatches=4))
    rows = scaling_report(profile, 6, PlanRequest(memory_per_device=mem, microbatches=4))
    assert [r["gpus"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["feasible"] for r in rows] == [g >= k for g in range(1, 7)]
    ok = [r for r in rows if r["feasible"]]
    assert all(r["throughput"] > 0 and r["max_memory_bytes"] * 1.1 <= mem for r in ok)


def test_sweeps_refuse_a_request_naming_its_devices() -> None:
    request = PlanRequest(cluster=Cluster.homogeneous(2))
    with pytest.raises(PlanningError, match="^scaling_report varies the GPU count; pass"):
        scaling_report(random_profile(4, 0), 3, request)
    with pytest.raises(PlanningError, match="^min_gpus varies the GPU count; pass"):
        min_gpus(random_profile(4, 0), request=request)


def test_a_given_device_is_repeated_and_rows_stop_at_the_unit_count() -> None:
    profile = random_profile(3, 2)
    device = Device("fast", None, speed=2.0)
    rows = scaling_report(profile, 8, PlanRequest(microbatches=4), device=device)
    assert [r["gpus"] for r in rows] == [1, 2, 3]  # no more stages than units
    one = plan(profile, PlanRequest(cluster=Cluster([device]), microbatches=4, baselines=False))
    assert rows[0]["iteration_time_s"] == pytest.approx(one.iteration_time_s)
    assert all(r["efficiency"] == pytest.approx(r["speedup"] / r["gpus"]) for r in rows)


def test_min_gpus_says_when_nothing_fits() -> None:
    with pytest.raises(PlanningError, match="^no GPU count up to 2 fits; at 2 GPUs: "):
        min_gpus(random_profile(6, 1), 2, PlanRequest(memory_per_device=10**3, microbatches=2))


def test_plan_each_schedule_gives_a_plan_or_its_reason() -> None:
    profile = random_profile(8, 4)
    out = plan_each_schedule(profile, PlanRequest(gpus=2, microbatches=1))
    assert list(out) == list(PLAN_SCHEDULES)
    gpipe = out["gpipe"]
    assert isinstance(gpipe, Plan) and gpipe.schedule == "gpipe" and gpipe.baselines == {}
    # one micro-batch on 2 ranks: the looped schedules need M to be a multiple of K
    reasons = [v for v in out.values() if isinstance(v, str)]
    assert reasons and all("\n" not in r for r in reasons)
    two = plan_each_schedule(profile, PlanRequest(gpus=2, microbatches=4), ["1f1b", "zbv"])
    assert list(two) == ["1f1b", "zbv"]
    assert all(isinstance(p, Plan) and p.schedule == name for name, p in two.items())
