"""planner/chain.py: partitions as bounds, their bottleneck, and the DP's backtrack."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from autopipe.planner import Cluster, Device
from autopipe.planner.chain import backtrack, bottleneck, stage_key
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import cost_model, random_profile


def test_backtrack_by_hand() -> None:
    # stage 3 ends at 5 coming from 3, stage 2 at 3 from 1, stage 1 at 1 from 0
    preds = [np.array([0, 0, 0, 0, 0, 0]), np.array([0, 0, 0, 1, 0, 0]), np.array([0] * 5 + [3])]
    assert backtrack(preds, 5) == [0, 1, 3, 5]
    assert backtrack([np.zeros(4, int)], 3) == [0, 3]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(1, 7), st.integers(1, 4), st.integers(0, 10_000))
def test_a_min_sum_dp_backtracked_equals_brute_force(n: int, k: int, seed: int) -> None:
    """The predecessors a chain DP keeps, backtracked, give a partition whose cost is the
    brute-force optimum over every cut set."""
    if k > n:
        return
    rng = np.random.default_rng(seed)
    cost = [rng.uniform(0, 1, (n + 1, n + 1)) for _ in range(k)]  # cost[s][i, j]: units i..j-1
    for c in cost:
        c[np.tril_indices(n + 1)] = np.inf  # a stage holds at least one unit
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    preds = []
    for c in cost:
        cand = best[:, None] + c
        preds.append(np.argmin(cand, axis=0))
        best = cand.min(axis=0)
    bounds = backtrack(preds, n)
    total = sum(cost[s][bounds[s], bounds[s + 1]] for s in range(k))
    brute = min(
        sum(cost[s][b[s], b[s + 1]] for s in range(k))
        for cuts in itertools.combinations(range(1, n), k - 1)
        for b in [[0, *cuts, n]]
    )
    assert len(bounds) == k + 1 and bounds[0] == 0 and bounds[-1] == n
    assert total == pytest.approx(brute, rel=1e-12) and total == pytest.approx(best[n])


def test_bottleneck_is_the_slowest_stage_or_inf_when_one_does_not_fit() -> None:
    profile = random_profile(6, 3)
    cm = cost_model(profile, Cluster.homogeneous(3), 4, "gpipe", "never")
    bounds = [0, 2, 3, 6]
    assert bottleneck(cm, bounds) == max(c.time_s for c in cm.stage_costs(bounds))
    tight = cost_model(profile, Cluster.homogeneous(3, memory_bytes=10**3), 4, "gpipe", "never")
    assert bottleneck(tight, bounds) == math.inf


def test_stages_on_equal_devices_share_a_key() -> None:
    cluster = Cluster([Device("a", 10**9), Device("a", 10**9), Device("a", 10**9, speed=2.0)])
    cm = cost_model(random_profile(6, 0), cluster, 4, "gpipe", "never")
    assert stage_key(cm, 0) == stage_key(cm, 1) != stage_key(cm, 2)
    one = cost_model(random_profile(6, 0), Cluster.homogeneous(3), 4, "1f1b", "never")
    assert stage_key(one, 0) != stage_key(one, 1)  # 1F1B: a different number in flight
