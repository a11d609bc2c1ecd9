"""planner/baselines.py: the peers' partition rules and the frameworks' default splits."""

from __future__ import annotations

import itertools

import pytest
from autopipe.planner.baselines import (
    baseline_bounds,
    deepspeed_partition_balanced,
    framework_default_bounds,
    framework_shape,
    greedy_time_bounds,
    minmax_weight_bounds,
    uniform_bounds,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.core.profile import Profile, UnitProfile


def _cut_sets(n: int, k: int):  # type: ignore[no-untyped-def]
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [0, *cuts, n]


def _parts(weights: list[int], bounds: list[int]) -> list[int]:
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def test_uniform_gives_the_remainder_to_the_first_stages() -> None:
    assert uniform_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert uniform_bounds(4, 4) == [0, 1, 2, 3, 4]
    assert uniform_bounds(7, 1) == [0, 7]


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 5))
def test_minmax_weight_bounds_equal_brute_force(weights: list[int], k: int) -> None:
    if k > len(weights):
        return
    bounds = minmax_weight_bounds(weights, k)
    assert len(bounds) == k + 1 and all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
    best = min(max(_parts(weights, b)) for b in _cut_sets(len(weights), k))
    assert max(_parts(weights, bounds)) == best


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=8), st.integers(2, 4))
def test_deepspeeds_rule_minimizes_the_spread(weights: list[int], k: int) -> None:
    if k >= len(weights):
        return
    bounds = deepspeed_partition_balanced(weights, k)
    spread = max(_parts(weights, bounds)) - min(_parts(weights, bounds))
    best = min(
        max(_parts(weights, b)) - min(_parts(weights, b)) for b in _cut_sets(len(weights), k)
    )
    assert spread == best
    assert deepspeed_partition_balanced([1, 2], 4) == [0, 1, 2, 2, 2]  # fewer items than parts


def test_greedy_time_cuts_closest_to_the_running_share() -> None:
    # totals 1, 2, 3, 4, 5, 6 -> 21; targets 7 and 14: prefixes 6 / 10 and 10 / 15
    assert greedy_time_bounds([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]
    # one huge unit first: every stage still gets a unit
    assert greedy_time_bounds([100, 1, 1, 1], 4) == [0, 1, 2, 3, 4]


def _gpt(layers: int = 6) -> Profile:
    names = ["tok_emb", *(f"blocks.{i}" for i in range(layers)), "norm", "head"]
    units = [
        UnitProfile(n, forward_s=1.0, parameter_count=10 * (i + 1)) for i, n in enumerate(names)
    ]
    return Profile(units=units, cut_bytes=[1] * (len(units) - 1), batch_size=4)


def test_baseline_bounds_by_name() -> None:
    p = _gpt()
    assert baseline_bounds("uniform", p, 3) == [0, 3, 6, 9]
    assert baseline_bounds("greedy-time", p, 3) == [0, 3, 6, 9]  # equal times
    assert (
        max(_parts([u.parameter_count for u in p.units], baseline_bounds("parameters", p, 2)))
        == 240
    )
    with pytest.raises(ValueError, match="unknown baseline 'magic'"):
        baseline_bounds("magic", p, 2)


@pytest.mark.parametrize(
    ("k", "torchtitan", "megatron"),
    [
        (1, [0, 9], [0, 9]),
        (2, [0, 4, 9], [0, 4, 9]),
        # torchtitan: 6 layers + embedding + output = 8 spread 3/3/2, the ends one layer fewer
        (3, [0, 3, 6, 9], [0, 3, 5, 9]),
        (4, [0, 2, 4, 6, 9], "needs the 6 layers divisible by 4 stages"),
        (9, "refuses 9 stages for 6 layers + embedding + output", "needs the 6 layers divisible by 9 stages"),
    ],
)  # fmt: skip
def test_framework_default_splits_of_a_layer_stack(k: int, torchtitan, megatron) -> None:  # type: ignore[no-untyped-def]
    for name, expected in (("torchtitan-even", torchtitan), ("megatron-uniform", megatron)):
        bounds, why = framework_default_bounds(name, _gpt(), k)
        if isinstance(expected, list):
            assert (bounds, why) == (expected, "")
        else:
            assert bounds is None and why == expected


def test_layer_counting_rules_need_one_stack() -> None:
    units = [UnitProfile(n, forward_s=1.0) for n in ("conv", "pool", "fc")]
    p = Profile(units=units, cut_bytes=[1, 1], batch_size=4)
    assert framework_default_bounds("megatron-uniform", p, 2) == (
        None,
        "splits the layers of one stack, and this model has no single one",
    )
    with pytest.raises(ValueError, match="unknown framework default 'colossal'"):
        framework_default_bounds("colossal", p, 2)


def test_the_schedule_each_framework_runs() -> None:
    assert framework_shape("torchtitan-even", "gpipe", 1) == ("gpipe", 1)
    assert framework_shape("torchtitan-even", "interleaved-1f1b", 4) == ("interleaved-1f1b", 2)
    assert framework_shape("megatron-uniform", "interleaved-1f1b", 3) == ("interleaved-1f1b", 3)
    assert framework_shape("megatron-uniform", "zbv", 2) == (
        "Megatron-Core has no zbv schedule (only 1F1B and interleaved 1F1B)"
    )
    assert framework_shape("deepspeed-parameters", "zbv", 2) == ("1f1b", 1)
