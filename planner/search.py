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

from autopipe.planner.baselines import BASELINES, baseline_bounds
from autopipe.planner.cluster import Cluster
from autopipe.planner.costs import (
    CHECKPOINT_MODES,
    OPTIMIZERS,
    SCHEDULES,
    CostModel,
    SegmentCost,
)
from autopipe.planner.costs import bytes_per_parameter as _state_bytes_per_parameter
from autopipe.planner.errors import PlanningError
from autopipe.planner.partition import (
    Partition,
    bottleneck,
    brute_force_partition,
    exact_partition,
    min_memory_needed,
    pareto_partitions,
)
from autopipe.planner.plan import Plan, StagePlan
from autopipe.planner.simulate import Simulation, gpipe_exact, simulate
from autopipe.profiler.profile import Profile

STRATEGIES = ("dp", "ilp", "brute-force", *BASELINES)
_BRUTE_FORCE_MAX = 2_000_000


def _gib(nbytes: float) -> str:
    """Human-readable bytes: GiB with 2 decimals from 1 GiB up, else MiB with 1 decimal."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, value: object) -> int:
    """``value`` as a Python int (numpy integers welcome); PlanningError unless it is >= 1."""
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        out = 0
    if isinstance(value, bool) or out < 1:
        raise PlanningError(f"{name}={value!r} must be a positive integer")
    return out


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
        return _divisors(batch_size)
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
            near = ", ".join(str(d) for d in _divisors(batch_size) if d <= 4 * m)[-40:]
            raise PlanningError(
                f"microbatches={m} does not divide batch size {batch_size}; pick a divisor (e.g. {near})"
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


def _simulate_costs(costs: list[SegmentCost], m: int, schedule: str) -> Simulation:
    """Iteration time and bubble of one plan on dedicated devices.

    GPipe uses its exact fill-drain formula (two flow shops; tests check it equals the event
    simulator), O(K); 1F1B runs the event simulator, O(K M log K).
    """
    if schedule == "gpipe":
        fwd = [c.forward_s + c.send_s for c in costs]
        bwd = [c.recompute_s + c.backward_s for c in costs]
        total = gpipe_exact(fwd, bwd, m)
        busy = [m * (f + b) for f, b in zip(fwd, bwd, strict=True)]
        bubble = 1.0 - sum(busy) / (len(costs) * total) if total > 0 else 0.0
        return Simulation(total, bubble, [], busy)
    return simulate(
        [c.forward_s for c in costs],
        [c.backward_s for c in costs],
        m,
        recompute_s=[c.recompute_s for c in costs],
        send_s=[c.send_s for c in costs],
        schedule=schedule,
        record_tasks=False,
    )


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
    optimizer: str = "adam",
    bytes_per_parameter: int | None = None,
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
    ``optimizer`` (``sgd``, ``sgd-momentum``, ``adam``, ``mixed-adam``); ``headroom`` is the
    share of device memory kept free.
    """
    if not profile.units:
        raise PlanningError("the profile has no units; profile a model with at least one module")
    _check_choice("schedule", schedule, (*SCHEDULES, "auto"))
    _check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
    _check_choice("strategy", strategy, STRATEGIES)
    if bytes_per_parameter is None:
        _check_choice("optimizer", optimizer, tuple(OPTIMIZERS))
        state_bpp = float(bytes_per_parameter_for(optimizer, profile))
    elif bytes_per_parameter <= 0:
        raise PlanningError(f"bytes_per_parameter={bytes_per_parameter} must be positive")
    else:
        state_bpp = float(bytes_per_parameter)
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
            sim = _simulate_costs(costs, m, sched)
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
    best = min(feasible, key=rank)
    out = _build_plan(profile, cluster, best, results, strategy, baselines, batch, checkpoint)
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
            sim = _simulate_costs(cand, r["m"], "gpipe")
            if sim.iteration_time_s < r["sim"].iteration_time_s * (1 - 1e-12):
                r["part"] = Partition(bounds, max(c.time_s for c in cand), "pareto")
                r["costs"], r["sim"] = cand, sim


def bytes_per_parameter_for(optimizer: str, profile: Profile) -> int:
    """Training-state bytes per parameter for ``optimizer`` at the profile's parameter size."""
    return _state_bytes_per_parameter(optimizer, max(int(profile.bytes_per_parameter), 1))


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
    have = _gib(min(caps)) if caps else "unlimited"
    tries = ["more GPUs"]
    if checkpoint in ("never", "except_last"):
        tries.append("checkpoint='auto' or 'always'")
    if len(results) == 1 or m == max(r["m"] for r in results):
        tries.append("more micro-batches")
    if strategy not in ("dp", "ilp", "brute-force"):
        tries.append("strategy='dp'")
    exc = PlanningError(
        f"no {k}-stage plan fits in {have} per device: the smallest memory per device that fits "
        f"is {_gib(need)} (M={m}, schedule={sched}, headroom included); try {', '.join(tries)}"
    )
    exc.min_memory_bytes = int(math.ceil(need))  # type: ignore[attr-defined]
    return exc


def _stage_names(profile: Profile, bounds: list[int]) -> list[list[str]]:
    names = profile.unit_names
    return [names[bounds[s] : bounds[s + 1]] for s in range(len(bounds) - 1)]


def _build_plan(
    profile: Profile,
    cluster: Cluster,
    best: dict[str, Any],
    results: list[dict[str, Any]],
    strategy: str,
    with_baselines: bool,
    batch: int,
    checkpoint: str,
) -> Plan:
    cm: CostModel = best["cm"]
    part: Partition = best["part"]
    costs: list[SegmentCost] = best["costs"]
    sim = best["sim"]
    m, sched = best["m"], best["schedule"]
    k = len(cluster)
    times = [c.time_s for c in costs]
    bott = max(range(k), key=lambda s: times[s])
    stages: list[StagePlan] = []
    for s, (units, c) in enumerate(zip(_stage_names(profile, part.bounds), costs, strict=True)):
        reason = ""
        if c.checkpoint:
            cap = cm.capacity[s]
            without = c.memory_without_checkpoint_bytes * (1.0 + cm.headroom)
            if checkpoint == "auto":
                reason = (
                    f"checkpointed: without it {_gib(without)} > {_gib(cap)} (headroom included)"
                )
            else:
                reason = f"checkpointed: checkpoint={checkpoint!r}"
        stages.append(
            StagePlan(
                index=s,
                device=cluster.devices[s].name,
                units=units,
                first_module=units[0],
                last_module=units[-1],
                forward_s=c.forward_s,
                backward_s=c.backward_s,
                recompute_s=c.recompute_s,
                send_s=c.send_s,
                memory_bytes=c.memory_bytes,
                parameter_bytes=c.parameter_bytes,
                optimizer_bytes=c.optimizer_bytes,
                activation_bytes=c.activation_bytes,
                checkpoint=c.checkpoint,
                reason=reason,
            )
        )
    v0 = cluster.devices[0].speed
    single_s = (
        sum(
            u.forward_at(batch, profile.batch_size) + u.backward_at(batch, profile.batch_size)
            for u in profile.units
        )
        / v0
    )
    it = sim.iteration_time_s
    notes = [
        f"bottleneck: stage {bott} ({stages[bott].first_module} .. {stages[bott].last_module}) "
        f"at {times[bott] * 1e3:.4g} ms per micro-batch"
    ]
    notes += [f"stage {st.index} {st.reason}" for st in stages if st.reason]
    notes.append(_why_m(best, results))
    if part.algorithm == "pareto":
        notes.append(
            f"partition trades the bottleneck ({times[bott] * 1e3:.4g} ms vs the minimum "
            f"{best['min_bottleneck_s'] * 1e3:.4g} ms) for a smaller max forward + max backward, "
            "which is what GPipe's fill-drain time depends on"
        )
    infeasible = sorted({r["m"] for r in results if r["part"] is None and r["schedule"] == sched})
    if infeasible:
        notes.append(f"M in {infeasible} does not fit in memory with schedule={sched}")
    baselines: dict[str, dict[str, Any]] = {}
    if with_baselines:
        others = [b for b in (*BASELINES, "dp") if b != strategy]
        for name in others:
            baselines[name] = _evaluate_baseline(name, cm, profile, m, sched)
        summary = [
            f"{name} {b['iteration_time_s'] / it:.2f}x"
            for name, b in baselines.items()
            if b["feasible"]
        ]
        if summary:
            notes.append(
                f"iteration time relative to this plan (M={m}, {sched}): " + ", ".join(summary)
            )
    return Plan(
        num_stages=k,
        microbatches=m,
        microbatch_size=batch // m,
        batch_size=batch,
        stages=stages,
        schedule=sched,
        iteration_time_s=it,
        bubble_fraction=sim.bubble_fraction,
        throughput=batch / it if it > 0 else math.inf,
        speedup=single_s / it if it > 0 else 1.0,
        bottleneck_stage=bott,
        strategy=strategy,
        memory_per_device=min(
            (d.memory_bytes for d in cluster.devices if d.memory_bytes is not None), default=None
        ),
        optimality_gap=part.optimality_gap,
        model=profile.model,
        profile_mode=profile.mode,
        baselines=baselines,
        notes=notes,
        meta={
            "algorithm": part.algorithm,
            "bottleneck_s": times[bott],
            "min_bottleneck_s": best.get("min_bottleneck_s", times[bott]),
            "frontier": best.get("frontier"),
            "single_device_time_s": single_s,
            "checkpoint_mode": checkpoint,
            "headroom": cm.headroom,
            "state_bytes_per_parameter": cm.state_factor * max(int(profile.bytes_per_parameter), 1),
            "candidates": [
                {
                    "microbatches": r["m"],
                    "schedule": r["schedule"],
                    "feasible": r["part"] is not None,
                    "iteration_time_s": r["sim"].iteration_time_s
                    if r["part"] is not None
                    else None,
                    "bottleneck_s": r["part"].bottleneck_s if r["part"] is not None else None,
                }
                for r in results
            ],
        },
    )


def _why_m(best: dict[str, Any], results: list[dict[str, Any]]) -> str:
    m, sched, it = best["m"], best["schedule"], best["sim"].iteration_time_s
    text = f"M={m}, schedule={sched}: iteration {it * 1e3:.4g} ms, bubble {best['sim'].bubble_fraction:.1%}"
    rivals = [r for r in results if r["part"] is not None and r is not best]
    if not rivals:
        return text + " (the only feasible candidate)"
    same = sorted((r for r in rivals if r["schedule"] == sched), key=lambda r: r["m"])
    lower = [r for r in same if r["m"] < m][-1:]
    higher = [r for r in same if r["m"] > m][:1]
    parts = [f"M={r['m']} {r['sim'].iteration_time_s * 1e3:.4g} ms" for r in lower + higher]
    other = [r for r in rivals if r["schedule"] != sched]
    if other:
        o = min(other, key=lambda r: r["sim"].iteration_time_s)
        parts.append(f"best {o['schedule']} {o['sim'].iteration_time_s * 1e3:.4g} ms at M={o['m']}")
    return text + (" (vs " + ", ".join(parts) + ")" if parts else "")


def _evaluate_baseline(
    name: str, cm: CostModel, profile: Profile, m: int, sched: str
) -> dict[str, Any]:
    """A strategy's figures at the plan's (M, schedule); infeasible ones carry their memory need."""
    if name == "dp":
        part = exact_partition(cm)
        cm.clear_cache()
        bounds = part.bounds if part is not None else None
    else:
        bounds = baseline_bounds(name, profile, cm.num_stages)
    if bounds is None:
        return {"iteration_time_s": None, "bottleneck_s": None, "balance": [], "feasible": False}
    costs = cm.stage_costs(bounds)
    balance = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    sim = _simulate_costs(costs, m, sched)
    return {
        "iteration_time_s": sim.iteration_time_s,
        "bottleneck_s": max(c.time_s for c in costs),
        "balance": balance,
        "feasible": all(c.feasible for c in costs),
        "bubble_fraction": sim.bubble_fraction,
        "max_memory_bytes": max(c.memory_bytes for c in costs),
        "microbatches": m,
        "schedule": sched,
        "stages": [_stage_row(c) for c in costs],
    }


def _stage_row(c: SegmentCost) -> dict[str, Any]:
    return {
        "forward_s": c.forward_s,
        "backward_s": c.backward_s,
        "recompute_s": c.recompute_s,
        "send_s": c.send_s,
        "parameter_bytes": c.parameter_bytes,
        "optimizer_bytes": c.optimizer_bytes,
        "activation_bytes": c.activation_bytes,
        "memory_bytes": c.memory_bytes,
        "checkpoint": c.checkpoint,
    }


def scaling_report(profile: Profile, max_gpus: int, **kw: Any) -> list[dict[str, Any]]:
    """Plan for K = 1 .. min(max_gpus, units) equal devices; one row per K.

    Rows: ``gpus``, ``feasible``, ``iteration_time_s``, ``throughput``, ``speedup``,
    ``efficiency`` (speedup / K), ``microbatches``, ``schedule``, ``max_memory_bytes``, ``error``.
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
            p = plan(profile, k, **kw)
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


def min_gpus(profile: Profile, max_gpus: int | None = None, **kw: Any) -> int:
    """Smallest K (up to ``max_gpus``, default: the unit count) whose plan fits in memory."""
    if "cluster" in kw:
        raise PlanningError("min_gpus varies the GPU count; pass memory_per_device, not cluster")
    kw.setdefault("baselines", False)
    limit = len(profile.units) if max_gpus is None else min(max_gpus, len(profile.units))
    last: PlanningError | None = None
    for k in range(1, limit + 1):
        try:
            plan(profile, k, **kw)
            return k
        except PlanningError as exc:
            last = exc
    raise PlanningError(f"no GPU count up to {limit} fits; at {limit} GPUs: {last}")
