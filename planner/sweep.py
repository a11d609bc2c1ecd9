"""Sweeps: over the GPU count (``scaling_report``, ``min_gpus``; each K is one ``plan``
call, so the cost is ``max_gpus`` planner runs) and over the schedules
(``plan_each_schedule``, one ``plan`` call per schedule). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from autopipe.planner.errors import PlanningError
from autopipe.planner.planning import plan

from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest, Schedule
from autopipe.core.vocabulary import PLAN_SCHEDULES


def _plan_k(profile: Profile, k: int, device: Device | None, request: PlanRequest) -> Plan:
    """``request`` planned on K devices (``device`` repeated K times, or K of the profile's
    device with the request's ``memory_per_device``), without baselines."""
    if device is None:
        return plan(profile, dataclasses.replace(request, gpus=k, baselines=False))
    cluster = Cluster([device] * k)
    return plan(profile, dataclasses.replace(request, gpus=None, cluster=cluster, baselines=False))


def _varied_gpus(request: PlanRequest | None, what: str) -> PlanRequest:
    """The request a GPU-count sweep varies (a default one for None); PlanningError for a
    request naming its devices (the sweep chooses them)."""
    if request is None:
        return PlanRequest()
    if request.cluster is not None:
        raise PlanningError(f"{what} varies the GPU count; pass memory_per_device, not cluster")
    return request


def scaling_report(
    profile: Profile,
    max_gpus: int,
    request: PlanRequest | None = None,
    *,
    device: Device | None = None,
) -> list[dict[str, Any]]:
    """Plan ``request`` for K = 1 .. min(max_gpus, units) equal devices; one row per K.

    ``device``: the device to repeat K times (memory, link); default: the profile's device
    with the request's ``memory_per_device``. The request's ``gpus`` is replaced by each K
    (a request with a ``cluster`` is refused: K varies) and baselines are not evaluated.
    Rows: ``gpus``, ``feasible``, ``iteration_time_s``, ``throughput``, ``speedup``,
    ``efficiency`` (speedup / K), ``microbatches``, ``schedule``, ``bubble_fraction``,
    ``max_memory_bytes``, ``error`` (infeasible rows carry only ``gpus``, ``feasible``, ``error``).
    """
    request = _varied_gpus(request, "scaling_report")
    rows: list[dict[str, Any]] = []
    for k in range(1, min(max_gpus, len(profile.units)) + 1):
        try:
            p = _plan_k(profile, k, device, request)
        except PlanningError as exc:
            rows.append({"gpus": k, "feasible": False, "error": str(exc)})
            continue
        rows.append(
            {
                "gpus": k,
                "feasible": True,
                "iteration_time_s": p.iteration_time_s,
                "throughput": p.throughput,
                "speedup": p.speedup,
                "efficiency": p.speedup / k,
                "microbatches": p.microbatches,
                "schedule": p.schedule,
                "bubble_fraction": p.bubble_fraction,
                "max_memory_bytes": max(s.memory_bytes for s in p.stages),
                "error": "",
            }
        )
    return rows


def min_gpus(
    profile: Profile,
    max_gpus: int | None = None,
    request: PlanRequest | None = None,
    *,
    device: Device | None = None,
) -> int:
    """Smallest K (up to ``max_gpus``, default: the unit count) whose plan of ``request``
    fits in memory (K and the devices as :func:`scaling_report` varies them)."""
    request = _varied_gpus(request, "min_gpus")
    limit = len(profile.units) if max_gpus is None else min(max_gpus, len(profile.units))
    last: PlanningError | None = None
    for k in range(1, limit + 1):
        try:
            _plan_k(profile, k, device, request)
            return k
        except PlanningError as exc:
            last = exc
    raise PlanningError(f"no GPU count up to {limit} fits; at {limit} GPUs: {last}")


def plan_each_schedule(
    profile: Profile, request: PlanRequest, schedules: Sequence[str] | None = None
) -> dict[str, Plan | str]:
    """The best plan of each schedule for ``request`` (its ``schedule`` and, unless the
    request fixes V, ``virtual_stages`` replaced per schedule), or the one-line reason there
    is none (a pre-flight rule, or nothing fits memory): what ``autopipe plot --schedules``
    draws side by side. One ``plan`` call per schedule."""
    out: dict[str, Plan | str] = {}
    for name in schedules or PLAN_SCHEDULES:
        try:
            # the request validates the name (a bad one is its one-line reason)
            one = dataclasses.replace(request, schedule=cast(Schedule, name), baselines=False)
            out[name] = plan(profile, one)
        except PlanningError as exc:
            out[name] = str(exc)
    return out
