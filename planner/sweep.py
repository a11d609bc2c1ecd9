"""Sweeps: over the GPU count (``scaling_report``, ``min_gpus``; each K is one ``plan``
call, so the cost is ``max_gpus`` planner runs) and over the schedules
(``plan_each_schedule``, one ``plan`` call per schedule). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autopipe.planner.errors import PlanningError
from autopipe.planner.planning import plan

from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import PLAN_SCHEDULES


def _plan_k(profile: Profile, k: int, device: Device | None, kw: dict[str, Any]) -> Any:
    if device is None:
        return plan(profile, k, **kw)
    return plan(profile, cluster=Cluster([device] * k), **kw)


def scaling_report(
    profile: Profile, max_gpus: int, *, device: Device | None = None, **kw: Any
) -> list[dict[str, Any]]:
    """Plan for K = 1 .. min(max_gpus, units) equal devices; one row per K.

    ``device``: the device to repeat K times (memory, link); default: the profile's device
    with ``memory_per_device`` from ``kw``.
    Rows: ``gpus``, ``feasible``, ``iteration_time_s``, ``throughput``, ``speedup``,
    ``efficiency`` (speedup / K), ``microbatches``, ``schedule``, ``bubble_fraction``,
    ``max_memory_bytes``, ``error`` (infeasible rows carry only ``gpus``, ``feasible``, ``error``).
    ``kw`` is passed to ``plan`` (``cluster`` is not allowed: K varies).
    """
    if "cluster" in kw:
        raise PlanningError(
            "scaling_report varies the GPU count; pass memory_per_device, not cluster"
        )
    kw.setdefault("baselines", False)
    rows = []
    for k in range(1, min(max_gpus, len(profile.units)) + 1):
        try:
            p = _plan_k(profile, k, device, kw)
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
    profile: Profile, max_gpus: int | None = None, *, device: Device | None = None, **kw: Any
) -> int:
    """Smallest K (up to ``max_gpus``, default: the unit count) whose plan fits in memory."""
    if "cluster" in kw:
        raise PlanningError("min_gpus varies the GPU count; pass memory_per_device, not cluster")
    kw.setdefault("baselines", False)
    limit = len(profile.units) if max_gpus is None else min(max_gpus, len(profile.units))
    last: PlanningError | None = None
    for k in range(1, limit + 1):
        try:
            _plan_k(profile, k, device, kw)
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
            out[name] = plan(profile, dataclasses.replace(request, schedule=name, baselines=False))
        except PlanningError as exc:
            out[name] = str(exc)
    return out
