"""``plan``: choose stages, micro-batch count, schedule and checkpointing together.

Torch-free. For every candidate (M, schedule) the chosen strategy finds the partition with the
smallest bottleneck stage time under the memory limits (exact for ``dp``, ``ilp`` and
``brute-force``); the discrete-event simulator then gives that plan's iteration time, and the
fastest feasible candidate wins. Cost: (#M x #schedules) x (partition + O(K M log K) simulation).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from autopipe.planner.assemble import build_plan, simulate_costs
from autopipe.planner.baselines import BASELINES, baseline_bounds
from autopipe.planner.chain import Partition, bottleneck
from autopipe.planner.cluster import Cluster
from autopipe.planner.costs import CHECKPOINT_MODES, SCHEDULES, CostModel
from autopipe.planner.errors import PlanningError
from autopipe.planner.partition import brute_force_partition, exact_partition
from autopipe.planner.plan import Plan
from autopipe.planner.probe import min_memory_needed, pareto_partitions
from autopipe.profiler.optimizer_state import (
    AUTO,
    OPTIMIZERS,
    default_optimizer,
    training_state_bytes_per_parameter,
)
from autopipe.profiler.profile import Profile

from autopipe.humanize import format_bytes

STRATEGIES = ("dp", "ilp", "brute-force", *BASELINES)
_BRUTE_FORCE_MAX = 2_000_000


MAX_AUTO_MICROBATCHES = 4096
"""``microbatches="auto"`` tries the divisors of the batch size up to this many: beyond it
per-call overhead dominates any bubble saved, and 1F1B's simulation is O(K M log K)."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n >= 1`` in increasing order, in O(sqrt(n)) steps (a
    batch size of 10^12 has 169 of them, found in a million steps, not 10^12)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if d * d != n]
    return small + large


def divisor_hint(n: int, near: int, count: int = 6) -> str:
    """``"pick a divisor (e.g. 4, 8, 16)"``: the ``count`` divisors of ``n`` closest to
    ``near``, in increasing order, for the errors about a micro-batch count that does not
    divide the batch size (the planner's and the CLI's)."""
    nearest = sorted(sorted(divisors(n), key=lambda d: abs(d - near))[:count])
    return f"pick a divisor (e.g. {', '.join(map(str, nearest))})"


def _positive_int(name: str, value: object) -> int:
    """``value`` as a Python int (numpy integers welcome); PlanningError unless it is >= 1."""
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        out = 0
    if isinstance(value, bool) or out < 1:
        raise PlanningError(f"{name}={value!r} must be a positive integer")
    return out


def training_state(
    profile: Profile, optimizer: str = "auto", bytes_per_parameter: float | None = None
) -> tuple[str, float]:
    """``(optimizer, bytes per parameter)`` the plan charges for parameters, gradients and
    optimizer state (docs/cost-model.md).

    ``bytes_per_parameter`` wins (the optimizer is then reported as ``"custom"``). ``"auto"``
    takes the profile's choice when it was made explicitly (``autopipe profile --optimizer``
    / ``--bytes-per-parameter``), else the default for the profile's parameter size:
    mixed-precision Adam (16 bytes) for 16-bit parameters, Adam (16) for fp32. O(1).
    """
    if bytes_per_parameter is not None:
        if not bytes_per_parameter > 0:
            raise PlanningError(f"bytes_per_parameter={bytes_per_parameter} must be positive")
        return "custom", float(bytes_per_parameter)
    key = optimizer.lower().replace("_", "-") if isinstance(optimizer, str) else optimizer
    _check_choice("optimizer", key, (AUTO, *OPTIMIZERS))
    parameter_size_bytes = max(int(profile.bytes_per_parameter), 1)
    if key == AUTO:
        if profile.meta.get("optimizer_chosen"):
            recorded = profile.meta.get("state_bytes_per_parameter")
            if recorded:
                return "custom", float(recorded)
            key = profile.optimizer
        else:
            key = default_optimizer(parameter_size_bytes)
    return key, float(training_state_bytes_per_parameter(key, parameter_size_bytes))


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise PlanningError(
            f"{name}={value!r} is not valid; use one of {', '.join(map(repr, allowed))}"
        )


def _resolve_cluster(
    profile: Profile, gpus: int | None, cluster: Cluster | None, memory_per_device: int | None
) -> Cluster:
    if (gpus is None) == (cluster is None):
        raise PlanningError("pass exactly one of gpus=K or cluster=Cluster(...)")
    if memory_per_device is not None and memory_per_device <= 0:
        raise PlanningError(
            f"memory_per_device={memory_per_device} must be a positive number of bytes"
        )
    if cluster is None:
        assert gpus is not None
        cluster = Cluster.homogeneous(
            _positive_int("gpus", gpus), profile.device, memory_per_device
        )
    elif memory_per_device is not None:
        # An explicit memory_per_device fills in devices whose memory is unknown.
        cluster = Cluster(
            [
                d
                if d.memory_bytes is not None
                else type(d)(**{**vars(d), "memory_bytes": memory_per_device})
                for d in cluster.devices
            ]
        )
    k = len(cluster)
    if k < 1:
        raise PlanningError("the cluster has no devices; give at least one")
    if k > len(profile.units):
        raise PlanningError(
            f"{k} stages need at least {k} units but the profile has {len(profile.units)}; "
            f"use at most {len(profile.units)} GPUs or profile with finer units"
        )
    for d in cluster.devices:
        if d.speed <= 0 or d.link_bandwidth_bytes_per_s <= 0 or d.link_latency_s < 0:
            raise PlanningError(
                f"device {d.name!r} needs speed > 0, bandwidth > 0 and latency >= 0"
            )
    return cluster


def _candidate_microbatches(batch_size: int, microbatches: int | str | Sequence[int]) -> list[int]:
    if isinstance(microbatches, bool):
        raise PlanningError(f"microbatches={microbatches!r} must be a positive integer")
    if isinstance(microbatches, str) and microbatches.strip().isdigit():
        microbatches = int(microbatches)
    if isinstance(microbatches, str):
        if microbatches != "auto":
            raise PlanningError(
                f"microbatches={microbatches!r}: give 'auto', an integer or a list of integers"
            )
        return [m for m in divisors(batch_size) if m <= MAX_AUTO_MICROBATCHES]
    try:
        values = [operator.index(microbatches)]  # type: ignore[arg-type]
    except TypeError:
        try:
            values = list(microbatches)
        except TypeError:
            raise PlanningError(
                f"microbatches={microbatches!r}: give 'auto', an integer or a list of integers"
            ) from None
    if not values:
        raise PlanningError("microbatches is an empty list; give at least one candidate or 'auto'")
    values = [_positive_int("microbatches", m) for m in values]
    for m in values:
        if batch_size % m:
            raise PlanningError(
                f"microbatches={m} does not divide batch size {batch_size}; "
                + divisor_hint(batch_size, m)
            )
    return sorted(set(values))


def _partition(
    cm: CostModel, strategy: str, profile: Profile, time_limit_s: float
) -> Partition | None:
    if strategy == "dp":
        return exact_partition(cm)
    if strategy == "ilp":
        from autopipe.planner.ilp import ilp_partition  # PuLP only when asked for

        return ilp_partition(cm, time_limit_s=time_limit_s)
    if strategy == "brute-force":
        if math.comb(cm.n_units - 1, cm.num_stages - 1) > _BRUTE_FORCE_MAX:
            raise PlanningError(
                f"brute-force over C({cm.n_units - 1}, {cm.num_stages - 1}) cut sets is too slow; use strategy='dp'"
            )
        return brute_force_partition(cm)
    bounds = baseline_bounds(strategy, profile, cm.num_stages)
    value = bottleneck(cm, bounds)
    return Partition(bounds, value, strategy) if math.isfinite(value) else None


def plan(
    profile: Profile,
    gpus: int | None = None,
    *,
    batch_size: int | None = None,
    microbatches: int | str | Sequence[int] = "auto",
    memory_per_device: int | None = None,
    cluster: Cluster | None = None,
    schedule: str = "gpipe",
    checkpoint: str = "never",
    strategy: str = "dp",
    optimizer: str = "auto",
    bytes_per_parameter: float | None = None,
    headroom: float = 0.10,
    baselines: bool = True,
    time_limit_s: float = 30.0,
) -> Plan:
    """Plan a K-stage pipeline for ``profile``; raises ``PlanningError`` if nothing fits.

    ``gpus=K`` (K equal devices named after the profile's device, ``memory_per_device`` bytes
    each, ``None`` = unlimited) or ``cluster`` (devices in pipeline order). ``microbatches``:
    an integer, a list of candidates, or ``"auto"`` (every divisor of the batch size).
    ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"auto"`` (the faster feasible one).
    ``checkpoint``: ``"never"``, ``"always"``, ``"except_last"`` or ``"auto"`` (per stage, only
    where the activations would not fit). ``strategy``: ``"dp"`` (exact), ``"ilp"`` (exact, CBC,
    ``time_limit_s`` per solve), ``"brute-force"``, or a baseline ``"uniform"``,
    ``"parameters"``, ``"greedy-time"``. Memory per parameter: ``bytes_per_parameter`` or from
    ``optimizer`` (``auto``, ``sgd``, ``sgd-momentum``, ``adam``, ``adamw``, ``mixed-adam``,
    ``none``; see :func:`training_state`); the choice is recorded in ``Plan.optimizer`` and
    ``Plan.state_bytes_per_parameter``. ``headroom`` is the share of device memory kept free.
    """
    if not profile.units:
        raise PlanningError("the profile has no units; profile a model with at least one module")
    _check_choice("schedule", schedule, (*SCHEDULES, "auto"))
    _check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
    _check_choice("strategy", strategy, STRATEGIES)
    chosen_optimizer, state_bpp = training_state(profile, optimizer, bytes_per_parameter)
    if not headroom >= 0 or not math.isfinite(headroom):
        raise PlanningError(f"headroom={headroom} must be a fraction >= 0 (0.1 keeps 10% free)")
    cluster = _resolve_cluster(profile, gpus, cluster, memory_per_device)
    batch = profile.batch_size if batch_size is None else batch_size
    batch = _positive_int("batch_size", batch)
    m_list = _candidate_microbatches(batch, microbatches)
    schedules = list(SCHEDULES) if schedule == "auto" else [schedule]

    def model(m: int, sched: str) -> CostModel:
        return CostModel(
            profile,
            cluster,
            batch_size=batch,
            microbatches=m,
            schedule=sched,
            checkpoint=checkpoint,
            state_bytes_per_parameter=state_bpp,
            headroom=headroom,
        )

    results: list[dict[str, Any]] = []
    for sched in schedules:
        for m in m_list:
            cm = model(m, sched)
            part = _partition(cm, strategy, profile, time_limit_s)
            cm.clear_cache()
            if part is None:
                results.append({"m": m, "schedule": sched, "cm": cm, "part": None})
                continue
            costs = cm.stage_costs(part.bounds)
            sim = simulate_costs(costs, m, sched)
            results.append(
                {"m": m, "schedule": sched, "cm": cm, "part": part, "costs": costs, "sim": sim}
            )
    feasible = [r for r in results if r["part"] is not None]
    if not feasible:
        raise _infeasible_error(results, cluster, checkpoint, strategy)
    for r in feasible:
        r["min_bottleneck_s"] = r["part"].bottleneck_s
        r["frontier"] = None

    def rank(r: dict[str, Any]) -> tuple:
        # Fastest; ties go to fewer micro-batches (less per-call overhead) and then to GPipe.
        return (r["sim"].iteration_time_s, r["m"], schedules.index(r["schedule"]))

    if strategy == "dp":
        _refine_gpipe(feasible, rank)
        _adopt_faster_heuristics(feasible, profile)
    best = min(feasible, key=rank)
    out = build_plan(profile, cluster, best, results, strategy, baselines, batch, checkpoint)
    out.optimizer = chosen_optimizer
    out.state_bytes_per_parameter = state_bpp
    out.meta["parameter_size_bytes"] = max(int(profile.bytes_per_parameter), 1)
    # The unit granularity lets the runtime re-trace the model into the plan's units.
    out.meta["granularity"] = profile.granularity
    # The request, JSON-ready, so that plots and tools can re-plan the same problem.
    out.meta["options"] = {
        "batch_size": batch,
        "microbatches": microbatches if isinstance(microbatches, str) else m_list,
        "schedule": schedule,
        "checkpoint": checkpoint,
        "strategy": strategy,
        "optimizer": optimizer,
        "bytes_per_parameter": bytes_per_parameter,
        "headroom": headroom,
        "memory_per_device": memory_per_device,
        "time_limit_s": time_limit_s,
    }
    return out


def _refine_gpipe(feasible: list[dict[str, Any]], rank, max_walks: int = 3) -> None:
    """Walk the (max forward part, max backward part) frontier for the best GPipe candidates.

    GPipe's time is ``sum + (M-1)(max f + max q)``; the min-bottleneck partition minimises
    ``max (f + q)`` instead, which is the same only when one stage holds both maxima. Walks
    GPipe candidates in order of their current time while a walk could still beat the best
    plan so far (lower bound: ``(M-1) x min bottleneck + total work / fastest device``), at
    most ``max_walks`` walks; a candidate takes a frontier partition that simulates faster.
    """
    walked = 0
    for r in sorted(feasible, key=rank):
        if walked >= max_walks or r["schedule"] != "gpipe":
            continue
        best_now = min(feasible, key=rank)
        cm0: CostModel = r["cm"]
        work = float(cm0.fwd_prefix[-1] + cm0.bwd_prefix[-1]) / float(cm0.speed.max())
        bound = (r["m"] - 1) * r["min_bottleneck_s"] + work
        if r is not best_now and bound >= best_now["sim"].iteration_time_s:
            continue
        costs = r["costs"]
        f_max = max(c.forward_s + c.send_s for c in costs)
        q_max = max(c.recompute_s + c.backward_s for c in costs)
        if f_max + q_max <= max(c.time_s for c in costs) * (1 + 1e-12):
            continue  # one stage holds both maxima: the min-bottleneck partition is already best
        walked += 1
        cm: CostModel = r["cm"]
        points, complete = pareto_partitions(cm)
        r["frontier"] = {"points": len(points), "complete": complete}
        for bounds in points:
            cand = cm.stage_costs(bounds)
            sim = simulate_costs(cand, r["m"], "gpipe")
            if sim.iteration_time_s < r["sim"].iteration_time_s * (1 - 1e-12):
                r["part"] = Partition(bounds, max(c.time_s for c in cand), "pareto")
                r["costs"], r["sim"] = cand, sim


def _adopt_faster_heuristics(feasible: list[dict[str, Any]], profile: Profile) -> None:
    """Let a baseline's partition stand in where it simulates faster than the exact one.

    The DP is exact for the bottleneck (and, via ``_refine_gpipe``, for GPipe's fill-drain
    time on equal devices), but a 1F1B iteration also depends on how the other stages line
    up, so a heuristic cut can occasionally simulate a little faster. The baselines are cheap
    to evaluate (3 partitions per candidate, O(K M) simulation each), so taking the faster one
    guarantees the plan is never slower than any baseline under the same cost model.
    """
    for r in feasible:
        cm: CostModel = r["cm"]
        for name in BASELINES:
            bounds = baseline_bounds(name, profile, cm.num_stages)
            cand = cm.stage_costs(bounds)
            if not all(c.feasible for c in cand):
                continue
            sim = simulate_costs(cand, r["m"], r["schedule"])
            if sim.iteration_time_s < r["sim"].iteration_time_s * (1 - 1e-12):
                r["part"] = Partition(bounds, max(c.time_s for c in cand), f"dp+{name}")
                r["costs"], r["sim"] = cand, sim


def _infeasible_error(
    results: list[dict[str, Any]], cluster: Cluster, checkpoint: str, strategy: str
) -> PlanningError:
    k = len(cluster)
    if strategy in BASELINES:  # the baseline's own partition is fixed: its fullest stage decides

        def need_of(cm: CostModel) -> float:
            bounds = baseline_bounds(strategy, cm.profile, k)
            return max(cm.segment_memory_need(s, bounds[s], bounds[s + 1]) for s in range(k))
    else:
        need_of = min_memory_needed
    needs = [(need_of(r["cm"]), r["m"], r["schedule"]) for r in results]
    need, m, sched = min(needs)
    caps = [d.memory_bytes for d in cluster.devices if d.memory_bytes is not None]
    have = format_bytes(min(caps), fixed=True) if caps else "unlimited"
    tries = ["more GPUs"]
    if checkpoint in ("never", "except_last"):
        tries.append("checkpoint='auto' or 'always'")
    if len(results) == 1 or m == max(r["m"] for r in results):
        tries.append("more micro-batches")
    if strategy not in ("dp", "ilp", "brute-force"):
        tries.append("strategy='dp'")
    exc = PlanningError(
        f"no {k}-stage plan fits in {have} per device: the smallest memory per device that fits "
        f"is {format_bytes(need, fixed=True)} (M={m}, schedule={sched}, headroom included); "
        f"try {', '.join(tries)}"
    )
    exc.min_memory_bytes = int(math.ceil(need))  # type: ignore[attr-defined]
    return exc
