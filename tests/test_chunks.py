"""planner/chunks.py: chunks on their ranks, their links, and the proven lower bound."""

from __future__ import annotations

import math
import random

import pytest
from autopipe.planner import Cluster, Device
from autopipe.planner.candidate import Candidate
from autopipe.planner.chunks import ScheduleShape, chunk_cluster, cost_model_for, lower_bound_s
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import random_cluster, random_profile

from autopipe.core.vocabulary import PLAN_SCHEDULES, SINGLE_SCHEDULES

KW = dict(batch_size=32, state_bytes_per_parameter=16.0, headroom=0.1)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.sampled_from(PLAN_SCHEDULES),
    st.integers(2, 3),
    st.integers(0, 10_000),
    st.sampled_from(["never", "always", "auto"]),
    st.booleans(),
)
def test_the_lower_bound_is_below_every_simulated_schedule(
    schedule: str, k: int, seed: int, checkpoint: str, hetero: bool
) -> None:
    """Whatever the cut, devices and re-materialization, the simulated iteration is never
    below ``lower_bound_s``."""
    v = 1 if schedule in SINGLE_SCHEDULES else 2
    m = 2 * k * v  # satisfies every schedule's rule on M
    n = k * v + seed % 5
    profile = random_profile(n, seed, overhead=seed % 2 == 0)
    cluster = random_cluster(k, seed, None) if hetero else Cluster.homogeneous(k)
    shape = ScheduleShape.of(schedule, k, v, m)
    cm = cost_model_for(profile, cluster, shape, checkpoint=checkpoint, **KW)
    bound = lower_bound_s(cm, shape, cluster)
    cand = Candidate(m, schedule, cm, shape=shape, cluster=cluster)
    r = random.Random(seed)
    for _ in range(4):
        cuts = sorted(r.sample(range(1, n), shape.num_chunks - 1))
        simulated = cand.evaluate([0, *cuts, n]).iteration_time_s
        assert bound <= simulated * (1 + 1e-12)
    assert bound > 0


def test_the_lower_bound_by_hand() -> None:
    """Two equal units of F = 1, B = 2 on two devices of speeds 1 and 3, M = 4, GPipe:
    work 4 x 6 / 4 = 6; heaviest unit 4 x 3 / 3 = 4; one micro-batch's path 6 / 3 = 2."""
    from autopipe.core.profile import Profile, UnitProfile

    units = [UnitProfile(f"u{i}", forward_s=1.0, backward_s=2.0) for i in range(2)]
    profile = Profile(units=units, cut_bytes=[0], batch_size=4)
    cluster = Cluster([Device("a", speed=1.0), Device("b", speed=3.0)])
    shape = ScheduleShape.of("gpipe", 2, 1, 4)
    cm = cost_model_for(profile, cluster, shape, checkpoint="never", **{**KW, "batch_size": 16})
    assert lower_bound_s(cm, shape, cluster) == pytest.approx(6.0)


def test_v_shape_chunks_send_over_the_right_links() -> None:
    cluster = Cluster(
        [Device("r0", 1000, 1.0, 1e9, 1e-6), Device("r1", 2000, 2.0, 5e9, 2e-6)],
        host_throughput=1.5,
    )
    shape = ScheduleShape.of("zbv", 2, 2, 4)
    assert shape.ranks == [0, 1, 1, 0] and shape.num_chunks == 4 and shape.split_backward
    devices = chunk_cluster(cluster, shape, memory_share=0.5).devices
    assert [d.name for d in devices] == ["r0", "r1", "r1", "r0"]
    assert [d.memory_bytes for d in devices] == [500, 1000, 1000, 500]
    assert [d.speed for d in devices] == [1.0, 2.0, 2.0, 1.0]
    # r0 -> r1 over r0's link; r1 -> r1 is no send; r1 -> r0 back up the V over r0's link.
    links = [(d.link_bandwidth_bytes_per_s, d.link_latency_s) for d in devices]
    assert links == [(1e9, 1e-6), (math.inf, 0.0), (1e9, 1e-6), (1e9, 1e-6)]
    assert chunk_cluster(cluster, shape).host_throughput == 1.5


def test_looped_chunks_go_round_the_ranks() -> None:
    shape = ScheduleShape.of("interleaved-1f1b", 3, 2, 6)
    assert shape.ranks == [0, 1, 2, 0, 1, 2] and not shape.split_backward
    assert len(shape.orders) == 3 and len(shape.held) == len(shape.full) == 6
    assert all(f >= 1 for f in shape.full)
    cluster = Cluster.homogeneous(3, memory_bytes=999, link_bandwidth_bytes_per_s=7e9)
    devices = chunk_cluster(cluster, shape).devices
    assert all(d.link_bandwidth_bytes_per_s == 7e9 for d in devices)  # rank 2 -> rank 0 too
    assert all(d.memory_bytes == 999 for d in devices)


def test_the_plan_records_which_chunks_split_backward_and_the_runtime_runs_that(
    tmp_path: object,
) -> None:
    """Which chunks run backward unsplit is decided once, by the planner
    (``StagePlan.split_backward``, kept in the plan file); the distributed runtime reads it
    (before, ``_unsplit_chunks`` decided again from the chunks: a chunk the plan priced
    unsplit for a shared parameter was said to run unsplit for its shapes)."""
    import dataclasses
    from pathlib import Path
    from types import SimpleNamespace

    from autopipe.planner import plan
    from autopipe.runtime.distributed.pipeline import _unsplit_chunks

    from autopipe.core.plan import Plan, load_plan
    from autopipe.core.request import PlanRequest

    profile = random_profile(8, seed=5)
    # unit 5 calls one layer twice: torch's split weight pass cannot take it (the profiler's
    # ``backward_unsplit``)
    units = list(profile.units)
    units[5] = dataclasses.replace(units[5], backward_unsplit="parameter 'w' is used 2 times")
    profile = dataclasses.replace(profile, units=units)
    request = PlanRequest(gpus=2, schedule="zbv", microbatches=4, checkpoint="never")
    p = plan(profile, request)
    by_chunk = [s.split_backward for s in p.stages]
    holder = next(i for i, s in enumerate(p.stages) if "layer5" in s.units)
    assert holder > 0 and by_chunk[holder] is False and by_chunk[0] is True
    assert [i for i, b in enumerate(by_chunk) if not b] == [holder]
    # priced as it runs: the unsplit chunk's whole backward in B, its W empty
    assert p.stages[holder].backward_weight_s == 0.0
    assert p.stages[holder].backward_input_s == pytest.approx(p.stages[holder].backward_s)
    path = Path(str(tmp_path)) / "plan.json"
    p.save(path)
    assert [s.split_backward for s in load_plan(path).stages] == by_chunk
    # the runtime reads the plan's decision (no fake-tensor run here: examples=None)
    chunks = [SimpleNamespace(checkpoint=False) for _ in p.stages]
    everyone = list(range(len(p.stages)))
    unsplit = _unsplit_chunks(p, everyone, chunks, None)  # type: ignore[arg-type]
    assert unsplit[holder].startswith("the plan runs it unsplit")
    # a 1F1B plan records nothing, and its file has no such key
    one = plan(profile, dataclasses.replace(request, schedule="1f1b", virtual_stages=1))
    assert all(s.split_backward is None for s in one.stages)
    assert all("split_backward" not in s for s in one.to_dict()["stages"])
    assert Plan.from_dict(one.to_dict()).stages[0].split_backward is None
