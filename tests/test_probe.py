"""planner/probe.py: the parametric min-bottleneck search and the smallest memory that fits."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from autopipe.planner import Cluster
from autopipe.planner import probe as probe_module
from autopipe.planner.costs import CostModel
from autopipe.planner.partition import dp_partition
from autopipe.planner.probe import (
    _Prober,
    min_memory_needed,
    no_cut_within,
    probe_partition,
    time_only_fits,
)
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


def _with(cm_profile: object, cluster: Cluster, m: int, schedule: str, checkpoint: str,
          state: float) -> CostModel:  # fmt: skip
    """``planner_instances.cost_model`` with ``state`` bytes of training state per parameter."""
    return CostModel(
        cm_profile, cluster, batch_size=32, microbatches=m, schedule=schedule,  # type: ignore[arg-type]
        checkpoint=checkpoint, state_bytes_per_parameter=state, headroom=0.1,
    )  # fmt: skip


def _probed_none(cm: CostModel, limit_s: float) -> bool:
    return not time_only_fits(cm, limit_s) or _Prober(cm).probe(limit_s) is None


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(2, 9),
    st.integers(0, 10_000),
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "auto"]),
    st.floats(0.3, 1.5),
    st.floats(0.5, 1.0),
    st.floats(1.0, 2.0),
    st.floats(0.5, 1.0),
)
def test_a_remembered_no_cut_answers_as_the_probe_would(
    n: int, seed: int, schedule: str, checkpoint: str, share: float, less_memory: float,
    more_state: float, lower: float,
) -> None:  # fmt: skip
    """``no_cut_within`` gives the probe's own answer, whether it probes or reuses a "no"
    found on the same pipeline with less state, more memory and a higher limit (#35)."""
    probe_module._NO_CUT.clear()
    k = 1 + seed % min(n, 4)
    profile = random_profile(n, seed)
    cluster = random_cluster(k, seed, 4 * 10**6)
    tighter = Cluster(
        [replace(d, memory_bytes=int(d.memory_bytes * less_memory)) for d in cluster.devices]  # type: ignore[operator]
    )
    first = _with(profile, cluster, 4, schedule, checkpoint, 16.0)
    second = _with(profile, tighter, 4, schedule, checkpoint, 16.0 * more_state)
    best = probe_partition(first)
    work = float(first.fwd_prefix[-1] + first.bwd_prefix[-1])
    limit_s = (best.bottleneck_s if best is not None else work) * share
    assert no_cut_within(first, limit_s) == _probed_none(first, limit_s)
    assert no_cut_within(second, limit_s * lower) == _probed_none(second, limit_s * lower)


def test_a_remembered_no_cut_saves_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pipeline with more state and no more memory, at a lower limit: no probe."""
    probe_module._NO_CUT.clear()
    profile = random_profile(8, 1)
    # 70 MB: the memory re-computes some stage (0.0120 s bottleneck; 0.0107 s at 80 MB)
    cluster = Cluster.homogeneous(3, memory_bytes=7 * 10**7, link_bandwidth_bytes_per_s=1e10)
    zero2 = _with(profile, cluster, 4, "1f1b", "auto", 16.0)
    best = probe_partition(zero2)
    assert best is not None
    limit_s = best.bottleneck_s * 0.999  # just below the least bottleneck: no cut
    assert time_only_fits(zero2, limit_s)  # the memory-aware probe decides it
    calls = [0]
    real = _Prober.probe

    def counted(self: _Prober, *args: float) -> list[int] | None:
        calls[0] += 1
        return real(self, *args)

    monkeypatch.setattr(_Prober, "probe", counted)
    assert no_cut_within(zero2, limit_s)
    assert calls[0] == 1
    zero1 = _with(profile, cluster, 4, "1f1b", "auto", 20.0)
    assert no_cut_within(zero1, limit_s * 0.9)
    assert calls[0] == 1  # remembered
    assert no_cut_within(zero1, limit_s * 1.5) == _probed_none(zero1, limit_s * 1.5)
    assert calls[0] == 3  # a higher limit is not covered: probed (and probed again to check)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(1, 10),
    st.integers(0, 10_000),
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "auto"]),
    st.sampled_from([None, 2 * 10**6, 10**7]),
)
def test_bisecting_the_segment_times_finds_the_same_bottleneck(
    n: int, seed: int, schedule: str, checkpoint: str, memory: int | None
) -> None:
    """Up to ``EXACT_VALUES_MAX_UNITS`` units the search bisects over the segments' own
    times (#35): the very float the halving of [lo, hi] finds, and the DP's."""
    k = 1 + seed % n
    cm = cost_model(
        random_profile(n, seed), random_cluster(k, seed, memory), 4, schedule, checkpoint
    )
    by_values = probe_partition(cm)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probe_module, "EXACT_VALUES_MAX_UNITS", 0)
        by_halving = probe_partition(cm)
    reference = dp_partition(cm)
    assert (by_values is None) == (by_halving is None) == (reference is None)
    if by_values is not None and by_halving is not None and reference is not None:
        assert by_values.bottleneck_s == by_halving.bottleneck_s == reference.bottleneck_s
