"""planner/partition.py: the exact partitioners and their tie-break, against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from autopipe.planner import Cluster
from autopipe.planner.chain import bottleneck
from autopipe.planner.partition import (
    banded_tie_break,
    brute_force_partition,
    dp_partition,
    exact_partition,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import cost_model, random_cluster, random_profile


def _least_total_at(cm, cap: float) -> float:
    """Brute force: the least total stage time over partitions whose bottleneck is <= cap."""
    n, k = cm.n_units, cm.num_stages
    totals = [
        sum(c.time_s for c in cm.stage_costs(b))
        for cuts in itertools.combinations(range(1, n), k - 1)
        for b in [[0, *cuts, n]]
        if bottleneck(cm, b) <= cap
    ]
    return min(totals)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(1, 8),
    st.integers(0, 10_000),
    st.sampled_from([None, 2e8, 1e9]),
    st.sampled_from(["gpipe", "1f1b"]),
    st.booleans(),
)
def test_exact_and_tie_broken_partitions_equal_brute_force(
    n: int, seed: int, memory: float | None, schedule: str, hetero: bool
) -> None:
    k = 1 + seed % n
    mem = None if memory is None else int(memory)
    cluster = random_cluster(k, seed, mem) if hetero else Cluster.homogeneous(k, memory_bytes=mem)
    cm = cost_model(random_profile(n, seed), cluster, 4, schedule, "auto")
    brute = brute_force_partition(cm)
    exact = exact_partition(cm)
    if brute is None:
        assert exact is None and dp_partition(cm) is None
        return
    assert exact is not None
    assert exact.bottleneck_s == pytest.approx(brute.bottleneck_s, rel=1e-12)
    # Among the partitions with that bottleneck, the least total stage time.
    least = _least_total_at(cm, brute.bottleneck_s)
    dp = dp_partition(cm)
    for bounds in (exact.bounds, dp.bounds):
        assert sum(c.time_s for c in cm.stage_costs(bounds)) == pytest.approx(least, rel=1e-9)
    banded = banded_tie_break(cm, brute.bottleneck_s)
    assert banded is not None
    assert sum(c.time_s for c in cm.stage_costs(banded)) == pytest.approx(least, rel=1e-9)


def test_the_band_gives_up_beyond_its_cells_and_below_every_stage() -> None:
    cm = cost_model(random_profile(10, 1), Cluster.homogeneous(3), 4, "gpipe", "never")
    cap = brute_force_partition(cm).bottleneck_s
    assert banded_tie_break(cm, cap, max_cells=5) is None
    assert banded_tie_break(cm, cap * 0.5) is None  # nothing fits under half the optimum
    assert dp_partition(cm, tie_break=False).bottleneck_s == pytest.approx(cap, rel=1e-12)


def test_brute_force_names_itself_and_none_when_nothing_fits() -> None:
    cm = cost_model(random_profile(5, 2), Cluster.homogeneous(2), 2, "gpipe", "never")
    assert brute_force_partition(cm).algorithm == "brute-force"
    tiny = cost_model(
        random_profile(5, 2), Cluster.homogeneous(2, memory_bytes=10), 2, "gpipe", "never"
    )
    assert brute_force_partition(tiny) is None and exact_partition(tiny) is None
    assert math.isinf(bottleneck(tiny, [0, 2, 5]))
