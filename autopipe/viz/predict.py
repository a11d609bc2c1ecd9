"""Predicted timelines: a Plan's per-stage costs run through the planner's schedule simulator.

Torch-free. The simulator (``autopipe.planner.simulate``) places forward, send, recompute and
backward tasks by the plan's schedule; ``shared_device_groups`` lists stages that share one
physical device (e.g. four "devices" that are all this machine's CPU), which the simulator
list-schedules one task at a time, so the prediction is of what really runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.timeline import Timeline
from autopipe.planner.simulate import simulate_plan


def shared_groups(devices: Sequence[Any]) -> list[list[int]]:
    """Stage indices grouped by equal device (``["cpu", "cpu", "cuda:1"]`` -> ``[[0, 1], [2]]``)."""
    groups: dict[str, list[int]] = {}
    for s, d in enumerate(devices):
        groups.setdefault(str(d), []).append(s)
    return list(groups.values())


def predicted_timeline(
    plan: Plan,
    *,
    devices: Sequence[Any] | None = None,
    label: str = "predicted",
) -> Timeline:
    """Simulate one iteration of ``plan``: the simulator's Timeline, labelled ``label``.

    ``devices``: the physical device of each stage when stages share devices (stages with
    equal devices are simulated on one device, named after it); ``None`` = one dedicated
    device per stage, as the planner assumes. O(T log K) for T tasks.
    """

    groups = shared_groups(devices) if devices is not None else None
    if devices is not None and len(devices) != plan.num_stages:
        raise ValueError(
            f"got {len(devices)} devices for a {plan.num_stages}-stage plan; give one per stage"
        )
    sim = simulate_plan(plan, shared_device_groups=groups)
    assert sim.timeline is not None  # simulate_plan records the tasks by default
    # The simulator numbers the groups' devices in group order.
    names = [str(devices[group[0]]) for group in groups] if devices is not None and groups else []
    return replace(sim.timeline, label=label, schedule=plan.schedule, device_names=names)
