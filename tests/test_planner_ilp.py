"""The ILP (PuLP + CBC) returns the DP's optimum on every instance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from autopipe.planner import Cluster, plan  # noqa: E402
from autopipe.planner.ilp import ilp_partition  # noqa: E402
from autopipe.planner.partition import brute_force_partition, dp_partition  # noqa: E402
from planner_instances import cost_model, random_cluster, random_profile  # noqa: E402

from autopipe.core.request import PlanRequest

CASES = [
    # (units, stages, seed, memory bytes, M, schedule, checkpoint, heterogeneous)
    (8, 3, 1, None, 4, "gpipe", "never", False),
    (9, 4, 2, 4e8, 8, "gpipe", "auto", False),
    (10, 3, 3, 3e8, 4, "1f1b", "auto", True),
    (12, 4, 4, 5e8, 2, "gpipe", "except_last", True),
    (7, 2, 5, 2e8, 8, "1f1b", "always", False),
    (9, 3, 6, 1e7, 4, "gpipe", "auto", False),  # infeasible: both say so
    (20, 5, 7, 1e9, 16, "gpipe", "auto", True),
]


@pytest.mark.parametrize("case", CASES)
def test_ilp_equals_dp(case) -> None:
    n, k, seed, mem, m, schedule, checkpoint, hetero = case
    profile = random_profile(n, seed)
    mem_i = None if mem is None else int(mem)
    cluster = (
        random_cluster(k, seed, mem_i) if hetero else Cluster.homogeneous(k, memory_bytes=mem_i)
    )
    cm = cost_model(profile, cluster, m, schedule, checkpoint)
    dp, ilp = dp_partition(cm), ilp_partition(cm, time_limit_s=20)
    assert (dp is None) == (ilp is None) == (brute_force_partition(cm) is None)
    if dp is not None:
        assert ilp.optimality_gap == 0.0
        assert ilp.bottleneck_s == pytest.approx(dp.bottleneck_s, rel=1e-6)


def test_ilp_strategy_in_plan_records_gap() -> None:
    profile = random_profile(10, 8)
    p = plan(profile, PlanRequest(gpus=3, microbatches=4, strategy="ilp"))
    q = plan(profile, PlanRequest(gpus=3, microbatches=4, strategy="dp"))
    assert p.strategy == "ilp" and p.optimality_gap == 0.0
    assert p.bottleneck_s == pytest.approx(q.min_bottleneck_s, rel=1e-6)
    assert p.baselines["dp"]["bottleneck_s"] >= p.bottleneck_s * (1 - 1e-6)
