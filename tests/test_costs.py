"""planner/costs.py: per-segment seconds and bytes, by hand and against their own matrices."""

from __future__ import annotations

import math

import numpy as np
import pytest
from autopipe.planner import Cluster, Device
from autopipe.planner.costs import CostModel, backward_input_share, backward_split_factor
from autopipe.planner.partition import dp_partition
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import cost_model, random_cluster, random_profile

from autopipe.core.profile import Profile, UnitProfile


def test_1f1b_memory_not_above_gpipe_at_equal_m() -> None:
    profile = random_profile(20, 5)
    cluster = Cluster.homogeneous(4)
    for m in (1, 2, 4, 8, 16):
        gp = cost_model(profile, cluster, m, "gpipe", "never")
        fb = cost_model(profile, cluster, m, "1f1b", "never")
        bounds = dp_partition(gp).bounds
        for s, (a, b) in enumerate(
            zip(gp.stage_costs(bounds), fb.stage_costs(bounds), strict=True)
        ):
            assert b.memory_bytes <= a.memory_bytes
            if m > 4 - s:  # strictly less once more micro-batches than its in-flight bound
                assert b.activation_bytes < a.activation_bytes or a.activation_bytes == 0


def test_cost_model_by_hand() -> None:
    """Two units, one stage each; every figure computed from the documented formulas."""
    units = [
        UnitProfile(
            "a",
            forward_s=0.4,
            backward_s=0.8,
            forward_overhead_s=0.1,
            parameter_count=10,
            parameter_bytes=40,
            activation_bytes=1000,
        ),
        UnitProfile(
            "b",
            forward_s=0.2,
            backward_s=0.4,
            parameter_count=5,
            parameter_bytes=20,
            activation_bytes=3000,
        ),
    ]
    profile = Profile(units=units, cut_bytes=[800], batch_size=8, input_bytes=400)
    cluster = Cluster([Device("x", 10**9, 2.0, 100.0, 0.5), Device("y", 10**9, 1.0)])
    cm = cost_model(profile, cluster, 4, "gpipe", "never")  # b = 32 / 4 = 8 = profile batch
    cm = CostModel(
        profile,
        cluster,
        batch_size=16,
        microbatches=4,
        schedule="1f1b",
        checkpoint="always",
        state_bytes_per_parameter=16,
        headroom=0.1,
    )  # b = 4: half the profiled batch
    a, b = cm.stage_costs([0, 1, 2])
    assert a.forward_s == pytest.approx((0.1 + 0.3 * 0.5) / 2.0)
    assert a.backward_s == pytest.approx(0.4 / 2.0)
    assert a.recompute_s == a.forward_s
    assert a.send_s == pytest.approx(800 * 0.5 / 100.0 + 0.5)
    assert b.send_s == 0.0
    assert (a.parameter_bytes, a.optimizer_bytes) == (40, 120)
    # 1F1B: stage 0 holds min(K - 0, M) = 2 inputs; checkpointed: inputs + one micro-batch's activations.
    assert a.activation_bytes == 400 * 0.5 * 2 + 1000 * 0.5
    assert b.activation_bytes == 800 * 0.5 * 1 + 3000 * 0.5


def test_backward_input_share_and_split_factor() -> None:
    assert backward_input_share(UnitProfile("relu", backward_s=1.0)) == 1.0  # no weights
    assert backward_input_share(UnitProfile("fc", backward_s=1.0, parameter_count=9)) == 0.5
    measured = UnitProfile("fc", backward_s=1.0, backward_input_s=0.3, backward_weight_s=0.9)
    assert backward_input_share(measured) == pytest.approx(0.25)
    assert backward_split_factor(measured) == pytest.approx(1.2)  # two passes cost more
    faster = UnitProfile("fc", backward_s=1.0, backward_input_s=0.3, backward_weight_s=0.5)
    assert backward_split_factor(faster) == 1.0  # never below the one pass
    assert backward_split_factor(UnitProfile("fc", backward_s=1.0)) == 1.0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.integers(1, 9),
    st.integers(0, 10_000),
    st.sampled_from([1, 2, 8]),
    st.sampled_from(["gpipe", "1f1b"]),
    st.sampled_from(["never", "always", "except_last", "auto"]),
    st.sampled_from([None, 2 * 10**8, 10**9]),
)
def test_the_matrix_equals_the_segment_by_segment_costs(
    n: int, seed: int, m: int, schedule: str, checkpoint: str, memory: int | None
) -> None:
    """``cost_matrix`` (what the partitioners read) prices every segment as ``segment``
    (what the plan reports) does, feasibility included."""
    k = 1 + seed % min(n, 3)
    cm = cost_model(
        random_profile(n, seed), random_cluster(k, seed, memory), m, schedule, checkpoint
    )
    for s in range(k):
        matrix = cm.cost_matrix(s)
        for i in range(n):
            for j in range(i + 1, n + 1):
                assert matrix[i, j] == pytest.approx(cm.segment_time(s, i, j), rel=1e-12)
                expected_max = max(u.activation_bytes for u in cm.profile.units[i:j])
                assert cm.unit_activation_max(i, j) == expected_max
                assert cm.unit_activation_max_matrix()[i, j] == expected_max


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(0, 10_000), st.sampled_from(["never", "auto", "always"]))
def test_a_segment_fits_in_exactly_its_memory_need(n: int, seed: int, checkpoint: str) -> None:
    profile = random_profile(n, seed)
    free = cost_model(profile, Cluster.homogeneous(1), 4, "gpipe", checkpoint)
    need = free.segment_memory_need(0, 0, n)
    options = {"never": [False], "always": [True], "auto": [False, True]}[checkpoint]
    least = min(free.segment(0, 0, n, checkpoint=c).memory_bytes for c in options)
    assert need == pytest.approx((1 + free.headroom) * least, abs=4)  # parts rounded to bytes
    at = cost_model(
        profile, Cluster.homogeneous(1, memory_bytes=math.ceil(need)), 4, "gpipe", checkpoint
    )
    assert at.segment(0, 0, n).feasible
    below = cost_model(
        profile,
        Cluster.homogeneous(1, memory_bytes=math.floor(need * (1 - 1e-6))),
        4,
        "gpipe",
        checkpoint,
    )
    assert not below.segment(0, 0, n).feasible and below.segment_time(0, 0, n) == math.inf


def test_sends_cross_the_senders_link_and_the_last_stage_sends_nothing() -> None:
    profile = random_profile(4, 1)
    cluster = Cluster([Device("a", None, 1.0, 1e9, 1e-4), Device("b", None, 1.0, 1e6, 0.0)])
    cm = cost_model(profile, cluster, 4, "gpipe", "never")  # micro-batch 8 of 32
    assert float(cm.send_s(0, 2)) == pytest.approx(profile.cut_bytes[1] * 0.25 / 1e9 + 1e-4)
    assert float(cm.send_s(1, 4)) == 0.0
    assert np.all(cm.inflight == 4)  # GPipe holds every micro-batch
    one = cost_model(profile, cluster, 4, "1f1b", "never")
    assert list(one.inflight) == [2, 1]  # 1F1B: stage s holds K - s
