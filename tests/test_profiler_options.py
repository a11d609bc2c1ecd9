"""The typed profiling options (autopipe.profiler.options): plain values, checks, and the
cache key."""

from __future__ import annotations

import time

import pytest
import torch
from autopipe.profiler.options import AnalyticOptions, MeasureOptions


def test_torch_values_and_lists_become_plain_values() -> None:
    options = MeasureOptions(
        device=torch.device("cpu"), dtype=torch.bfloat16, units=["a.*"], microbatch_sizes=[4, 2]
    )  # type: ignore[arg-type]
    assert options.device == "cpu" and options.dtype == "bfloat16"
    assert options.units == ("a.*",) and options.microbatch_sizes == (4, 2)
    analytic = AnalyticOptions(units=["b"], microbatch_sizes=[8])  # type: ignore[arg-type]
    assert analytic.units == ("b",) and analytic.microbatch_sizes == (8,)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"warmup": -1}, "need warmup >= 0 and repeat >= 1, got warmup=-1, repeat=5"),
        ({"repeat": 0}, "need warmup >= 0 and repeat >= 1, got warmup=2, repeat=0"),
        ({"bytes_per_parameter": 0.0}, "bytes_per_parameter=0.0 must be positive"),
    ],
)
def test_impossible_values_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        MeasureOptions(**fields)


def test_the_cache_key_is_plain_data() -> None:
    key = MeasureOptions(units=("a",), microbatch_sizes=(2,), clock=time.perf_counter).key()
    assert key["units"] == ["a"] and key["microbatch_sizes"] == [2]
    assert key["clock"] == "perf_counter"
    assert MeasureOptions().key()["clock"] == "auto"
    assert MeasureOptions(repeat=3).key() != MeasureOptions().key()
