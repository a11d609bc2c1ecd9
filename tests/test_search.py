"""planner/search.py: request checks, divisors and their hints, the training state charged."""

from __future__ import annotations

from typing import Any

import pytest
from autopipe.planner import Cluster, Device, PlanningError, plan
from autopipe.planner.search import divisor_hint, divisors, training_state
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_instances import random_profile

from autopipe.core.request import PlanRequest


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(gpus=11), "at most 10 GPUs"),
        (dict(gpus=0), "positive integer"),
        (dict(gpus=2, cluster=Cluster.homogeneous(2)), "exactly one of"),
        (dict(gpus=2, microbatches=5), "does not divide batch size 32"),
        (dict(gpus=2, batch_size=720, microbatches=100), "(e.g. 60, 72, 80, 90, 120, 144)"),
        (dict(gpus=2, microbatches=0), "positive integer"),
        (dict(gpus=2, strategy="magic"), "strategy='magic'"),
        (dict(gpus=2, schedule="zb"), "schedule='zb'"),
        (dict(gpus=2, checkpoint="sometimes"), "checkpoint='sometimes'"),
        (dict(gpus=2, optimizer="lion"), "optimizer='lion'"),
        (dict(gpus=2, memory_per_device=-1), "positive number of bytes"),
        (dict(gpus=2, batch_size=0), "batch_size=0"),
    ],
)
def test_bad_input_one_clear_line(kwargs, needle: str) -> None:
    with pytest.raises(PlanningError) as info:
        plan(random_profile(10, 0), PlanRequest(**kwargs))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_divisor_hint_names_the_nearest_divisors() -> None:
    assert divisor_hint(32, 5) == "pick a divisor (e.g. 1, 2, 4, 8, 16, 32)"
    assert divisor_hint(360, 7, count=3) == "pick a divisor (e.g. 5, 6, 8)"  # ties: the smaller


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 5000), st.one_of(st.none(), st.integers(1, 6000)))
def test_divisors_equal_trial_division(n: int, up_to: int | None) -> None:
    limit = n if up_to is None else up_to
    assert divisors(n, up_to) == [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def test_divisors_of_a_huge_batch_stop_at_the_bound() -> None:
    assert divisors(10**24, up_to=10) == [1, 2, 4, 5, 8, 10]
    assert divisors(2**61 - 1, up_to=4096) == [1]  # a Mersenne prime


def test_the_hint_looks_further_for_sparse_divisors() -> None:
    assert divisor_hint(97, 5) == "pick a divisor (e.g. 1, 97)"  # a prime: both it has
    assert divisor_hint(1024, 100, count=2) == "pick a divisor (e.g. 64, 128)"


def test_training_state_charged() -> None:
    profile = random_profile(3, 0)  # fp32 parameters
    assert training_state(profile) == ("adam", 16.0)
    assert training_state(profile, "SGD_Momentum") == ("sgd-momentum", 12.0)
    assert training_state(profile, "adam", bytes_per_parameter=20) == ("custom", 20.0)
    profile.bytes_per_parameter = 2
    assert training_state(profile) == ("mixed-adam", 16.0)
    profile.optimizer, profile.optimizer_chosen = "sgd", True  # chosen when profiling
    assert training_state(profile) == ("sgd", 4.0)
    profile.state_bytes_per_parameter = 10.0
    assert training_state(profile) == ("custom", 10.0)
    with pytest.raises(PlanningError, match=r"^bytes_per_parameter=0 must be positive$"):
        training_state(profile, bytes_per_parameter=0)
    with pytest.raises(PlanningError, match=r"^optimizer='lion' is not valid; use one of 'auto'"):
        training_state(profile, "lion")


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dict(gpus=2, microbatches=True), "microbatches=True must be a positive integer"),
        (
            dict(gpus=2, microbatches="many"),
            "microbatches='many': give 'auto', an integer or a list of integers",
        ),
        (
            dict(gpus=2, microbatches=()),
            "microbatches is an empty list; give at least one candidate or 'auto'",
        ),
        (
            dict(gpus=2, headroom=-0.1),
            "headroom=-0.1 must be a fraction >= 0 (0.1 keeps 10% free)",
        ),
        (
            dict(cluster=Cluster([])),
            "the cluster has no devices; give at least one",
        ),
        (
            dict(cluster=Cluster.homogeneous(2, host_throughput=0.0)),
            "host_throughput=0.0 must be > 0 devices' worth of compute",
        ),
        (
            dict(cluster=Cluster([Device("slow", speed=0.0), Device("b")])),
            "device 'slow' needs speed > 0, bandwidth > 0 and latency >= 0",
        ),
    ],
)
def test_more_requests_that_cannot_be_planned(request_: dict[str, Any], message: str) -> None:
    # A field that is bad on its own is refused when the request is built (issue 37).
    with pytest.raises(PlanningError) as info:
        plan(random_profile(10, 0), PlanRequest(**request_))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_candidates_given_as_a_string_or_list_are_sorted_and_unique() -> None:
    p = plan(random_profile(6, 1), PlanRequest(gpus=2, microbatches=(8, 2, 8), baselines=False))
    assert sorted({r.microbatches for r in p.candidates}) == [2, 8]
    q = plan(random_profile(6, 1), PlanRequest(gpus=2, microbatches="4", baselines=False))
    assert q.microbatches == 4
