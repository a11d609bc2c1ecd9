"""planner/candidate.py: pricing a partition of one (schedule, V, M), and its summary row."""

from __future__ import annotations

import math

import pytest
from autopipe.planner import Cluster
from autopipe.planner.candidate import Candidate
from autopipe.planner.chunks import ScheduleShape, chunk_works, cost_model_for
from autopipe.planner.simulate import simulate_schedule
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import random_profile

KW = dict(batch_size=32, state_bytes_per_parameter=16.0, headroom=0.1)


def _candidate(schedule: str, n: int, k: int, m: int, seed: int, **cluster_kw) -> Candidate:
    cluster = Cluster.homogeneous(k, **cluster_kw)
    shape = ScheduleShape.of(schedule, k, 1, m)
    cm = cost_model_for(random_profile(n, seed), cluster, shape, checkpoint="auto", **KW)
    return Candidate(m, schedule, cm, shape=shape, cluster=cluster)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(2, 8), st.integers(1, 4), st.sampled_from([1, 3, 8]), st.integers(0, 10_000))
def test_gpipes_closed_form_equals_the_simulator(n: int, k: int, m: int, seed: int) -> None:
    k = min(k, n)
    cand = _candidate("gpipe", n, k, m, seed, link_bandwidth_bytes_per_s=1e9)
    bounds = [round(i * n / k) for i in range(k + 1)]
    ev = cand.evaluate(bounds)
    works = chunk_works(cand.cost_model, bounds, ev.costs, False)
    sim = simulate_schedule(works, "gpipe", k, m, orders=cand.shape.orders, record_tasks=False)
    assert ev.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=1e-9)
    assert ev.simulation.bubble_fraction == pytest.approx(sim.bubble_fraction, rel=1e-9, abs=1e-12)
    assert ev.fits and ev.bounds == bounds and len(ev.costs) == k


def test_a_rank_over_its_memory_does_not_fit() -> None:
    cand = _candidate("1f1b", 6, 2, 4, 1, memory_bytes=10**4)
    ev = cand.evaluate([0, 3, 6])
    assert not ev.fits
    assert max(ev.peaks) * 1.1 > 10**4


def test_adopting_an_evaluation_makes_the_candidate_feasible() -> None:
    cand = _candidate("1f1b", 6, 2, 4, 2)
    assert not cand.feasible and cand.iteration_time_s == math.inf
    row = cand.summary()
    assert (row.feasible, row.iteration_time_s, row.bottleneck_s, row.lower_bound_s) == (
        False,
        None,
        None,
        None,
    )
    ev = cand.evaluate([0, 2, 6])
    cand.adopt_evaluation(ev, "by hand")
    assert cand.feasible and cand.iteration_time_s == ev.iteration_time_s
    assert cand.partition.bottleneck_s == max(c.time_s for c in ev.costs)
    assert cand.partition.algorithm == "by hand" and cand.peaks == ev.peaks
    row = cand.summary()
    assert row.feasible and row.schedule == "1f1b" and row.virtual_stages == 1
    assert row.microbatches == 4 and row.iteration_time_s == ev.iteration_time_s


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(0, 10_000))
def test_a_chunk_without_weight_gradients_has_no_negative_weight_pass(seed: int) -> None:
    """Units with no weight gradient (B is their whole backward) after units with one: the
    chunk's B and W come from prefix-sum differences that round apart, and W was priced at
    -1.7e-18 s (seeds 1, 2, 4, 6 here; an hf_t5 plan then failed its own loader in
    ``explain`` / ``emit``). W is never negative and B + W is the chunk's split backward."""
    p = random_profile(6, seed)
    for u in p.units[2:]:
        u.backward_input_s, u.backward_weight_s = max(u.backward_input_s, 1e-4), 0.0
    cluster = Cluster.homogeneous(2, link_bandwidth_bytes_per_s=1e9)
    shape = ScheduleShape.of("zbv", 2, 2, 4)
    cm = cost_model_for(p, cluster, shape, checkpoint="never", **KW)
    bounds = [0, 1, 2, 4, 6]
    ev = Candidate(4, "zbv", cm, shape=shape, cluster=cluster).evaluate(bounds)
    for work in chunk_works(cm, bounds, ev.costs, True):
        assert work.backward_input_s >= 0.0 and work.backward_weight_s >= 0.0
        assert work.backward_input_s + work.backward_weight_s <= work.backward_s * (1 + 1e-12)
