"""Fit an analytic profile's efficiency factors to one measured run, and re-price profiles.

An analytic unit time is a sum of three parts (see :mod:`autopipe.profiler.opcount`):
``compute_s`` (ops bound by FLOP/s, scales as 1/compute_eff), ``memory_s`` (ops bound by
bandwidth, 1/memory_eff) and ``kernels x launch_overhead``. :func:`calibrate` fits

    measured_s(unit, phase) ~= a * compute_s + b * memory_s + c * kernels * launch_s

by least squares with a, b, c >= 0 over all units and both phases (one sample each), and
returns the spec with ``compute_eff / a``, ``memory_eff / b``, ``launch_s * c``. A factor
that would exceed 1 is capped at 1 and the corresponding peak raised instead (the nominal
"cpu" entry can be slower than a real machine). Torch-free; O(units) plus a 3x3 solve.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import numpy as np
from autopipe.profiler.time_model import fit_time_model

from autopipe.core.catalog import DeviceSpec, DeviceSpecError, device_spec_from_dict
from autopipe.core.errors import UsageError
from autopipe.core.gemm import gemm_ceiling
from autopipe.core.profile import Profile
from autopipe.core.profile_records import Counting


class CalibrationError(UsageError, ValueError):
    """The analytic and measured profiles cannot be compared."""


def _counting(profile: Profile) -> Counting:
    counting = profile.counting
    if profile.mode != "analytic" or counting is None or not counting.units:
        raise CalibrationError(
            "expected an analytic profile from profile_analytic (it carries per-unit cost parts)"
        )
    if not counting.device_spec:
        raise CalibrationError("the analytic profile's counting has no device_spec")
    return counting


def spec_of(profile: Profile) -> DeviceSpec:
    """The DeviceSpec an analytic profile was priced with."""
    counting = _counting(profile)
    return device_spec_from_dict(counting.device_spec, origin="profile.counting.device_spec")


def calibrate(analytic: Profile, measured: Profile) -> DeviceSpec:
    """Scale the analytic spec's efficiency factors (and launch overhead) to fit ``measured``.

    Both profiles must have the same unit names and batch size. Returns the fitted spec;
    apply it with :func:`reprice`.
    """
    details = _counting(analytic).units
    if analytic.unit_names != measured.unit_names:
        raise CalibrationError(
            "analytic and measured profiles have different units; profile both with the same "
            "granularity and model"
        )
    if analytic.batch_size != measured.batch_size:
        raise CalibrationError(
            f"batch sizes differ (analytic {analytic.batch_size}, measured {measured.batch_size}); "
            "profile both at the same batch size"
        )
    spec = spec_of(analytic)
    rows, targets = [], []
    for detail, unit in zip(details, measured.units, strict=True):
        for phase, seconds in (("forward", unit.forward_s), ("backward", unit.backward_s)):
            part = detail[phase]
            rows.append(
                [
                    part["compute_s"],
                    part["memory_s"],
                    part["kernels"] * spec.kernel_launch_overhead_s,
                ]
            )
            targets.append(seconds)
    coef = _nonnegative_least_squares(np.array(rows, dtype=float), np.array(targets, dtype=float))
    return _scaled_spec(spec, coef, analytic.dtype)


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact NNLS for 3 unknowns: the best unconstrained fit over every support subset
    whose coefficients are all positive (7 subsets, each one small lstsq)."""
    best: tuple[float, np.ndarray] | None = None
    columns = [j for j in range(x.shape[1]) if np.any(x[:, j] > 0)]
    for size in range(1, len(columns) + 1):
        for subset in itertools.combinations(columns, size):
            sol, *_ = np.linalg.lstsq(x[:, subset], y, rcond=None)
            if np.any(sol <= 0):
                continue
            coef = np.zeros(x.shape[1])
            coef[list(subset)] = sol
            residual = float(np.sum((x @ coef - y) ** 2))
            if best is None or residual < best[0]:
                best = (residual, coef)
    if best is None:
        raise CalibrationError(
            "no positive fit: the measured times do not grow with the counted costs"
        )
    return best[1]


def _scaled_spec(spec: DeviceSpec, coef: np.ndarray, dtype: str) -> DeviceSpec:
    a, b, c = (float(v) for v in coef)
    peaks = dict(spec.peak_flops_per_s)
    bandwidth = spec.memory_bandwidth_bytes_per_s
    compute_eff, memory_eff = spec.compute_efficiency, spec.memory_efficiency
    if a > 0:
        # the counted matmuls ran at the GPU's ceiling for the dtype (autopipe.core.gemm)
        compute_eff = gemm_ceiling(spec, dtype) / a
        if compute_eff > 1:
            peaks = {k: v * compute_eff for k, v in peaks.items()}
            compute_eff = 1.0
    if b > 0:
        memory_eff = spec.memory_efficiency / b
        if memory_eff > 1:
            bandwidth *= memory_eff
            memory_eff = 1.0
    launch = spec.kernel_launch_overhead_s * c if c > 0 else spec.kernel_launch_overhead_s
    return dataclasses.replace(
        spec,
        name=spec.name if spec.name.endswith("(calibrated)") else f"{spec.name} (calibrated)",
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bandwidth,
        compute_efficiency=compute_eff,
        memory_efficiency=memory_eff,
        kernel_launch_overhead_s=launch,
        aliases=(),
        extra={**spec.extra, "calibration_coefficients": [a, b, c]},
    )


def _price(
    part: dict[str, Any], compute_scale: float, memory_scale: float, launch_s: float
) -> float:
    return (
        part["compute_s"] * compute_scale
        + part["memory_s"] * memory_scale
        + part["kernels"] * launch_s
    )


def priced_times(
    counting: Counting,
    batch_size: int,
    compute_scale: float,
    memory_scale: float,
    launch_s: float,
) -> dict[str, Any]:
    """Unit times from an analytic profile's stored cost parts (``counting``, counted at
    ``batch_size`` samples: ``Profile.batch_size``).

    ``compute_scale``/``memory_scale`` multiply the compute- and memory-bound parts (1.0 keeps
    the spec they were priced with), ``launch_s`` is the launch overhead per kernel. With
    parts at several micro-batch sizes, the per-unit overhead is the intercept ``a`` of the
    fit ``t(b) = a + c * b`` (``a, c >= 0``, capped at ``t(B)``); with one size it is the
    launch overheads. Returns lists ``forward_s``, ``backward_s``, ``forward_overhead_s``,
    ``backward_overhead_s`` (one entry per unit) and the loss's ``loss_forward_s``/
    ``loss_backward_s``.
    """
    base = counting.units
    smaller = counting.smaller_sizes
    big_b = batch_size
    sizes: list[float] = [float(big_b or 0)] + [float(s["microbatch_size"]) for s in smaller]
    out: dict[str, Any] = {}
    for phase in ("forward", "backward"):
        totals, overheads = [], []
        for i, unit in enumerate(base):
            t_big = _price(unit[phase], compute_scale, memory_scale, launch_s)
            if smaller and big_b:
                times = [t_big] + [
                    _price(s["units"][i][phase], compute_scale, memory_scale, launch_s)
                    for s in smaller
                ]
                overhead = min(fit_time_model(sizes, times)[0], t_big)
            else:
                overhead = unit[phase]["kernels"] * launch_s
            totals.append(t_big)
            overheads.append(overhead)
        out[f"{phase}_s"] = totals
        out[f"{phase}_overhead_s"] = overheads
        loss = counting.loss
        out[f"loss_{phase}_s"] = (
            _price(loss[phase], compute_scale, memory_scale, launch_s) if loss else 0.0
        )
    return out


def weight_flops_share(part: dict[str, Any]) -> float:
    """The share of a unit's backward that is its weight gradient (W), by FLOPs, from its
    counted parts (``{"forward": ..., "backward": ...}``): W redoes each parameter operand's
    forward FLOPs once (``dW = X^T dY`` for ``Y = X W``), B is the rest of the backward. In
    [0, 1]; 0 without backward FLOPs (memory-bound work counts as B)."""
    backward = float(part["backward"].get("flops", 0.0))
    weight = float(part["forward"].get("parameter_flops", 0.0))
    if backward <= 0:
        return 0.0
    return min(max(weight / backward, 0.0), 1.0)


def apply_times(profile: Profile, times: dict[str, Any]) -> None:
    """Write :func:`priced_times` output into ``profile`` (in place); each unit's backward
    is split into B and W by :func:`weight_flops_share` (so B + W = backward)."""
    parts = profile.counting.units if profile.counting is not None else []
    for i, unit in enumerate(profile.units):
        unit.forward_s = times["forward_s"][i]
        unit.backward_s = times["backward_s"][i]
        unit.forward_overhead_s = times["forward_overhead_s"][i]
        unit.backward_overhead_s = times["backward_overhead_s"][i]
        if i < len(parts):
            unit.backward_weight_s = unit.backward_s * weight_flops_share(parts[i])
            unit.backward_input_s = unit.backward_s - unit.backward_weight_s
    profile.total_forward_s = sum(times["forward_s"]) + times["loss_forward_s"]
    profile.total_backward_s = sum(times["backward_s"]) + times["loss_backward_s"]
    profile.loss_forward_s = times["loss_forward_s"]
    profile.loss_backward_s = times["loss_backward_s"]


def reprice(profile: Profile, spec: DeviceSpec) -> Profile:
    """The analytic ``profile`` with times re-priced for ``spec`` without re-counting the
    model: the same device with new efficiencies/peaks from :func:`calibrate`, or another
    device that has a peak for the profile's dtype (e.g. the slower GPUs of a mixed cluster)."""
    counting = _counting(profile)
    old = spec_of(profile)
    try:
        compute_scale = _rate(old, profile.dtype) / _rate(spec, profile.dtype)
    except DeviceSpecError as exc:
        raise CalibrationError(f"cannot re-price a {profile.dtype} profile: {exc}") from exc
    memory_scale = (old.memory_bandwidth_bytes_per_s * old.memory_efficiency) / (
        spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    )
    new = copy.deepcopy(profile)
    new.counting = _rescaled(counting, compute_scale, memory_scale)
    new.counting.device_spec = spec.to_dict()
    new.device = spec.name
    apply_times(
        new, priced_times(new.counting, new.batch_size, 1.0, 1.0, spec.kernel_launch_overhead_s)
    )
    return new


def _rescaled(counting: Counting, compute_scale: float, memory_scale: float) -> Counting:
    """Stored parts re-expressed at the new rates, so they stay consistent with the spec."""
    counting = copy.deepcopy(counting)

    def scale(part: dict[str, Any]) -> None:
        part["compute_s"] *= compute_scale
        part["memory_s"] *= memory_scale

    entries = [*counting.units, *(u for s in counting.smaller_sizes for u in s["units"])]
    if counting.loss:
        entries.append(counting.loss)
    for entry in entries:
        scale(entry["forward"])
        scale(entry["backward"])
    return counting


def _rate(spec: DeviceSpec, dtype: str) -> float:
    """Effective matmul FLOP/s for ``dtype``: the peak at the GPU's matmul ceiling
    (``autopipe.core.gemm``; calibration scales all of a spec's peaks together)."""
    return spec.peak_for(dtype) * gemm_ceiling(spec, dtype)
