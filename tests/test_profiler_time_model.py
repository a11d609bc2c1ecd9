"""The micro-batch-size time model t(b) = a + c * b and its constrained fit
(autopipe.profiler.time_model)."""

from __future__ import annotations

import pytest
from autopipe.profiler.time_model import fit_time_model


def test_fit_time_model_exact_and_clamped() -> None:
    assert fit_time_model([8, 2], [0.010, 0.004]) == pytest.approx((0.002, 0.001))
    assert fit_time_model([1, 2, 4], [0.003, 0.005, 0.009]) == pytest.approx((0.001, 0.002))
    a, c = fit_time_model([8, 2], [0.010, 0.001])  # superlinear: intercept would be < 0
    assert a == 0 and c > 0
    a, c = fit_time_model([8, 2], [0.004, 0.005])  # slower at smaller size: slope would be < 0
    assert c == 0 and a == pytest.approx(0.0045)
    assert fit_time_model([8], [0.008]) == (0.0, 0.001)


def test_recovers_overhead_and_per_sample_time_from_synthetic_times() -> None:
    """Times made from a = 3 ms, c = 0.5 ms/sample at five sizes give back a and c."""
    sizes = [1, 2, 4, 8, 16]
    times_s = [0.003 + 0.0005 * b for b in sizes]
    assert fit_time_model(sizes, times_s) == pytest.approx((0.003, 0.0005))


def test_least_squares_through_symmetric_noise() -> None:
    """+-0.1 ms around the line at symmetric sizes cancels: the fit is the line itself."""
    sizes = [2, 4, 6, 8]
    noise = [1e-4, -1e-4, -1e-4, 1e-4]
    times_s = [0.001 + 0.002 * b + e for b, e in zip(sizes, noise, strict=True)]
    assert fit_time_model(sizes, times_s) == pytest.approx((0.001, 0.002), rel=1e-9)


def test_clamped_fit_is_the_better_of_origin_and_constant() -> None:
    """Decreasing times: the constant (their mean) beats any line through the origin."""
    a, c = fit_time_model([1, 2, 3], [0.006, 0.005, 0.004])
    assert (a, c) == pytest.approx((0.005, 0.0))
    # Superlinear growth from 0: the line through the origin, slope b.t / b.b.
    a, c = fit_time_model([1, 2, 3], [0.0, 0.001, 0.004])
    assert a == 0.0 and c == pytest.approx((0.002 + 0.012) / 14)


def test_one_repeated_size_is_all_per_sample_and_bad_input_is_refused() -> None:
    assert fit_time_model([4, 4], [0.004, 0.006]) == pytest.approx((0.0, 0.00125))
    assert fit_time_model([0], [0.001]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="one time per size"):
        fit_time_model([1, 2], [0.001])
    with pytest.raises(ValueError, match="at least one size"):
        fit_time_model([], [])
