"""The numbers behind the bubble, balance and scaling plots, as JSON-able dicts.

Each function re-plans the same problem with one knob changed (M, strategy, K) through the
real planner, so every point on a plot is what ``autopipe plan`` would predict for that
choice. Nothing here changes the plan it is given. ``autopipe plan --plot`` stores the dicts
in ``Plan.plot_data`` of the plan it writes, so ``autopipe plot PLAN.json`` can redraw the
figures without the profile. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest
from autopipe.planner import PlanningError, scaling_report
from autopipe.planner import plan as make_plan
from autopipe.planner.search import MAX_AUTO_MICROBATCHES, divisors

_STAGE_KEYS = (
    "forward_s",
    "backward_s",
    "recompute_s",
    "send_s",
    "parameter_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "memory_bytes",
    "checkpoint",
)


def planning_options(plan: Plan) -> dict[str, Any]:
    """Keyword arguments that reproduce ``plan`` with ``autopipe.planner.plan``.

    Uses the plan's request (``Plan.request``) when present, then the plan's own fields
    (training state, batch size, schedule, strategy, memory limit).
    """
    opts: dict[str, Any] = {}
    if plan.request is not None:
        # The devices are the caller's to choose (a scaling sweep varies them); to_dict
        # makes fresh values, so the plan's request stays as it is.
        opts = {k: v for k, v in plan.request.to_dict().items() if k not in ("gpus", "cluster")}
    if plan.state_bytes_per_parameter:
        opts.setdefault("bytes_per_parameter", int(round(plan.state_bytes_per_parameter)))
    opts.setdefault("batch_size", plan.batch_size)
    opts.setdefault("schedule", plan.schedule)
    if opts.get("memory_per_device") is None:
        # A plan made for an explicit cluster records its capacity only on the Plan.
        opts["memory_per_device"] = plan.memory_per_device
    if plan.strategy in ("dp", "ilp", "uniform", "parameters", "greedy-time"):
        opts.setdefault("strategy", plan.strategy)
    return opts


def _planner_accepts(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less any keyword ``autopipe.planner.plan`` does not take (a plan saved by
    another version may record options this planner lacks)."""
    accepted = {f.name for f in dataclasses.fields(PlanRequest)}
    return {k: v for k, v in options.items() if k in accepted}


def replan(profile: Profile, plan: Plan, **overrides: Any) -> Plan | None:
    """``plan``'s problem re-planned with ``overrides`` (e.g. ``microbatches=8``).

    Returns None when the planner finds nothing that fits (``PlanningError``); other errors
    propagate. Options the planner does not accept are dropped.
    """

    kwargs = _planner_accepts(
        {"gpus": plan.num_stages, "baselines": False, **planning_options(plan), **overrides}
    )
    try:
        return make_plan(profile, PlanRequest(**kwargs))
    except PlanningError:
        return None


def bubble_data(
    plan: Plan,
    profile: Profile,
    ks: Sequence[int] | None = None,
    microbatches: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Simulated bubble fraction, iteration time and throughput for each M (and each K).

    ``ks`` defaults to the plan's K plus K/2 and 2K where they are valid; ``microbatches``
    to every divisor of the batch size up to ``MAX_AUTO_MICROBATCHES``. One planner call
    per (K, M).
    """
    k = plan.num_stages
    n_units = len(profile.units)
    if ks is None:
        ks = sorted({x for x in (k // 2, k, 2 * k) if 1 < x <= n_units} | {k})
    if microbatches is None:
        microbatches = divisors(plan.batch_size, up_to=MAX_AUTO_MICROBATCHES)
    ms = list(microbatches)
    curves = []
    for kk in ks:
        points: list[dict[str, Any]] = []
        for m in ms:
            p = (
                plan
                if (kk == k and m == plan.microbatches)
                else replan(profile, plan, gpus=kk, microbatches=m, schedule=plan.schedule)
            )
            if p is None:
                points.append({"microbatches": m, "feasible": False})
                continue
            points.append(
                {
                    "microbatches": m,
                    "feasible": True,
                    "iteration_time_s": p.iteration_time_s,
                    "throughput": p.throughput,
                    "bubble_fraction": p.bubble_fraction,
                }
            )
        curves.append({"num_stages": kk, "points": points})
    return {
        "num_stages": k,
        "chosen_microbatches": plan.microbatches,
        "batch_size": plan.batch_size,
        "schedule": plan.schedule,
        "curves": curves,
    }


def _stage_rows(plan: Plan) -> list[dict[str, Any]]:
    return [{key: getattr(s, key) for key in _STAGE_KEYS} for s in plan.stages]


def _strategy_entry(name: str, p: Plan | None) -> dict[str, Any]:
    if p is None:
        return {"name": name, "feasible": False, "stages": []}
    return {
        "name": name,
        "feasible": True,
        "iteration_time_s": p.iteration_time_s,
        "microbatches": p.microbatches,
        "bubble_fraction": p.bubble_fraction,
        "stages": _stage_rows(p),
    }


def balance_data(
    plan: Plan,
    profile: Profile | None,
    baselines: Sequence[str] = ("uniform", "parameters"),
) -> dict[str, Any]:
    """Per-stage time and memory parts for ``plan`` and each baseline strategy.

    Baselines are re-planned at the plan's M, schedule and memory limit. A baseline that does
    not fit memory is planned again without the limit, so its bars still show (over the red
    line) and it is flagged ``feasible: False``. Without a profile, baselines come from
    ``plan.baselines[name]["stages"]`` when the planner stored them.
    """
    label = "autopipe" if plan.strategy in ("dp", "ilp") else plan.strategy
    entries = [_strategy_entry(label, plan)]
    for name in baselines:
        if name == plan.strategy:
            continue
        if profile is not None:
            p = replan(
                profile, plan, strategy=name, microbatches=plan.microbatches, schedule=plan.schedule
            )
            entry = _strategy_entry(name, p)
            if p is None:
                p = replan(
                    profile,
                    plan,
                    strategy=name,
                    microbatches=plan.microbatches,
                    schedule=plan.schedule,
                    memory_per_device=None,
                )
                entry = {**_strategy_entry(name, p), "feasible": False}
        else:
            stored = plan.baselines.get(name, {})
            entry = {
                "name": name,
                "feasible": bool(stored.get("feasible", True)),
                "iteration_time_s": stored.get("iteration_time_s"),
                "microbatches": stored.get("microbatches"),
                "stages": list(stored.get("stages", [])),
            }
        entries.append(entry)
    return {"memory_limit_bytes": plan.memory_per_device, "strategies": entries}


def scaling_data(plan: Plan, profile: Profile, max_gpus: int | None = None) -> dict[str, Any]:
    """Throughput and fullest-device memory for K = 1..max_gpus (default: the plan's K).

    From the planner's ``scaling_report`` with the plan's options (M chosen automatically
    for each K). One planner call per K.
    """

    max_gpus = min(max_gpus or plan.num_stages, len(profile.units))
    opts = _planner_accepts({**planning_options(plan), "microbatches": "auto"})
    for varied in ("gpus", "cluster"):  # scaling_report varies K itself
        opts.pop(varied, None)
    rows = scaling_report(profile, max_gpus, PlanRequest(**opts))
    points = []
    for row in rows:
        if not row.get("feasible"):
            points.append({"num_stages": row["gpus"], "feasible": False})
            continue
        points.append(
            {
                "num_stages": row["gpus"],
                "feasible": True,
                "throughput": row["throughput"],
                "iteration_time_s": row["iteration_time_s"],
                "microbatches": row["microbatches"],
                "max_memory_bytes": row["max_memory_bytes"],
            }
        )
    return {
        "chosen_num_stages": plan.num_stages,
        "memory_limit_bytes": plan.memory_per_device,
        "points": points,
    }
