"""planner/probe.py: the parametric min-bottleneck search and the smallest memory that fits."""

from __future__ import annotations

import itertools

import pytest
from autopipe.planner import Cluster
from autopipe.planner.partition import dp_partition
from autopipe.planner.probe import _Prober, min_memory_needed, probe_partition, time_only_fits
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import cost_model, random_cluster, random_profile


def test_probe_handles_large_instance_like_dp() -> None:
    profile = random_profile(600, 13)
    cluster = Cluster.homogeneous(12, memory_bytes=4 * 10**9, link_bandwidth_bytes_per_s=1e10)
    for checkpoint in ("never", "auto"):
        cm = cost_model(profile, cluster, 16, "1f1b", checkpoint)
        a, b = dp_partition(cm), probe_partition(cm)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.bottleneck_s == pytest.approx(b.bottleneck_s, rel=1e-12)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    st.integers(1, 7),
    st.integers(0, 10_000),
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "auto"]),
)
def test_min_memory_needed_equals_brute_force(
    n: int, seed: int, schedule: str, checkpoint: str
) -> None:
    """The smallest equal memory per device at which some partition fits: the minimum over
    all partitions of their largest stage's need, to the bisection's 1e-6."""
    k = 1 + seed % n
    profile = random_profile(n, seed)
    cm = cost_model(profile, Cluster.homogeneous(k), 4, schedule, checkpoint)
    brute = min(
        max(cm.segment_memory_need(s, b[s], b[s + 1]) for s in range(k))
        for cuts in itertools.combinations(range(1, n), k - 1)
        for b in [[0, *cuts, n]]
    )
    found = min_memory_needed(cm)
    assert brute <= found <= brute * (1 + 2e-6)
    # and the probe agrees: a partition fits at that memory, none just below the optimum
    fits = cost_model(
        profile, Cluster.homogeneous(k, memory_bytes=int(found) + 1), 4, schedule, checkpoint
    )
    assert probe_partition(fits) is not None
    tight = cost_model(
        profile,
        Cluster.homogeneous(k, memory_bytes=int(brute * (1 - 1e-6))),
        4,
        schedule,
        checkpoint,
    )
    assert probe_partition(tight) is None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 9),
    st.integers(0, 10_000),
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "auto"]),
    st.floats(0.05, 1.5),
)
def test_the_time_only_check_never_refuses_what_the_probe_finds(
    n: int, seed: int, schedule: str, checkpoint: str, share: float
) -> None:
    """``time_only_fits`` is a relaxation of the probe: at any threshold where the probe
    finds a cut, it says it may fit; and at the min-bottleneck's own value it says so too,
    while well below the heaviest unit it refuses."""
    k = 1 + seed % n
    profile = random_profile(n, seed)
    speeds = random_cluster(k, seed, 2 * 10**9)  # unequal speeds and links
    cm = cost_model(profile, speeds, 4, schedule, checkpoint)
    best = probe_partition(cm)
    if best is None:
        return
    t = best.bottleneck_s * share
    prober = _Prober(cm)
    if prober.probe(t) is not None:
        assert time_only_fits(cm, t)
    assert time_only_fits(cm, best.bottleneck_s)
    heaviest = float(
        max(cm.fwd_prefix[1:] - cm.fwd_prefix[:-1] + cm.bwd_prefix[1:] - cm.bwd_prefix[:-1])
    )
    assert not time_only_fits(cm, heaviest / float(cm.speed.max()) * 0.5)  # the fastest rank's
