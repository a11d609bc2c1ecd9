"""Turn the chosen candidate into a ``Plan``: stages, figures, baselines and notes.

Torch-free. O(K) per plan plus one simulation per baseline.
"""

from __future__ import annotations

import math
from typing import Any

from autopipe.planner.baselines import (
    BASELINES,
    FRAMEWORK_DEFAULTS,
    baseline_bounds,
    framework_default_bounds,
    framework_shape,
)
from autopipe.planner.candidate import Candidate
from autopipe.planner.chunks import ScheduleShape, cost_model_for, splits_backward
from autopipe.planner.costs import SegmentCost
from autopipe.planner.partition import exact_partition
from autopipe.planner.simulate import Simulation, gpipe_exact, idle_fraction, simulate

from autopipe.core.cluster import Cluster
from autopipe.core.humanize import format_bytes
from autopipe.core.plan import Plan, StagePlan
from autopipe.core.plan_report import PlanReport, StageReport
from autopipe.core.profile import Profile


def simulate_costs(costs: list[SegmentCost], m: int, schedule: str) -> Simulation:
    """Iteration time and bubble of one plan on dedicated devices.

    GPipe uses its exact fill-drain formula (two flow shops; tests check it equals the event
    simulator), O(K); 1F1B runs the event simulator, O(K M log K).
    """
    if schedule == "gpipe":
        fwd = [c.forward_s + c.send_s for c in costs]
        bwd = [c.recompute_s + c.backward_s for c in costs]
        total = gpipe_exact(fwd, bwd, m)
        busy = [m * (f + b) for f, b in zip(fwd, bwd, strict=True)]
        bubble = idle_fraction(busy, len(costs), total)
        return Simulation(total, bubble, busy_s=busy)
    return simulate(
        [c.forward_s for c in costs],
        [c.backward_s for c in costs],
        m,
        recompute_s=[c.recompute_s for c in costs],
        send_s=[c.send_s for c in costs],
        schedule=schedule,
        record_tasks=False,
    )


def _stage_names(profile: Profile, bounds: list[int]) -> list[list[str]]:
    names = profile.unit_names
    return [names[bounds[s] : bounds[s + 1]] for s in range(len(bounds) - 1)]


def _unit_parameters(profile: Profile) -> dict[str, int] | None:
    """Each unit's parameter elements (``UnitProfile.parameter_count``), or None when the
    profile has no counts: a unit with parameter bytes but a count of 0 (a hand-written
    profile), whose plan then records none (``StagePlan.unit_parameters`` empty)."""
    if any(u.parameter_count <= 0 < u.parameter_bytes for u in profile.units):
        return None
    return {u.name: u.parameter_count for u in profile.units}


def build_plan(
    profile: Profile,
    cluster: Cluster,
    best: Candidate,
    candidates: list[Candidate],
    strategy: str,
    with_baselines: bool,
    batch: int,
    checkpoint: str,
) -> Plan:
    """The Plan of the chosen candidate ``best`` (feasible), with notes on why it beat the
    other ``candidates`` and, ``with_baselines``, the baselines' figures at its (M, schedule).
    Steps: the stages, the bounds, the notes, the baselines."""
    part, sim = best.partition, best.simulation
    assert part is not None and sim is not None
    m, k = best.microbatches, len(cluster)
    times = [c.time_s for c in best.costs]
    bott = max(range(len(times)), key=lambda s: times[s])
    stages = _stage_plans(profile, cluster, best, checkpoint)
    single_s = _single_device_s(profile, cluster, batch)
    it = sim.iteration_time_s
    # Proven <= it; min/max only absorb floating-point rounding (e.g. K = 1, where they meet).
    lower = min(best.lower_bound_s, it)
    gap = max(it / lower - 1.0, 0.0) if lower > 0 else 0.0
    notes = _notes(best, candidates, stages, bott, lower, gap)
    baselines: dict[str, dict[str, Any]] = {}
    if with_baselines:
        baselines = _baselines(best, profile, strategy)
        notes += _baseline_summary(baselines, best)
    return Plan(
        num_stages=k,
        virtual_stages=best.virtual_stages,
        microbatches=m,
        microbatch_size=batch // m,
        batch_size=batch,
        stages=stages,
        schedule=best.schedule,
        model=profile.model,
        report=PlanReport(
            lower_bound_s=lower,
            lower_bound_gap=gap,
            method=best.method,
            rank_peak_bytes=[int(math.ceil(p)) for p in best.peaks],
            iteration_time_s=it,
            bubble_fraction=sim.bubble_fraction,
            throughput=batch / it if it > 0 else math.inf,
            speedup=single_s / it if it > 0 else 1.0,
            bottleneck_stage=bott,
            strategy=strategy,
            memory_per_device=min(
                (d.memory_bytes for d in cluster.devices if d.memory_bytes is not None),
                default=None,
            ),
            optimality_gap=part.optimality_gap,
            profile_mode=profile.mode,
            baselines=baselines,
            notes=notes,
            partition_algorithm=part.algorithm,
            bottleneck_s=times[bott],
            min_bottleneck_s=min(best.min_bottleneck_s, times[bott]),
            single_device_time_s=single_s,
            candidates=[c.summary() for c in candidates],
            meta={"frontier": best.frontier, "refinement": best.refinement},
        ),
    )


def _stage_plans(
    profile: Profile, cluster: Cluster, best: Candidate, checkpoint: str
) -> list[StagePlan]:
    """One StagePlan per chunk of ``best``'s cut, in model order, each on its rank's device
    and saying why it is re-materialized. O(N + K V)."""
    cm, part, works = best.cost_model, best.partition, best.works
    assert part is not None
    ranks = best.shape.ranks if best.shape is not None else list(range(len(cluster)))
    counts = _unit_parameters(profile)
    split = best.shape is not None and best.shape.split_backward
    stages: list[StagePlan] = []
    for s, (units, c) in enumerate(
        zip(_stage_names(profile, part.bounds), best.costs, strict=True)
    ):
        i, j = part.bounds[s], part.bounds[s + 1]
        reason = ""
        if c.checkpoint:
            cap = cm.capacity_bytes[s]
            without = c.memory_without_checkpoint_bytes * (1.0 + cm.headroom)
            if checkpoint == "auto":
                reason = (
                    f"checkpointed: without it {format_bytes(without, fixed=True)} > "
                    f"{format_bytes(cap, fixed=True)} (headroom included)"
                )
            else:
                reason = f"checkpointed: checkpoint={checkpoint!r}"
            if c.checkpoint_granularity == "unit":
                reason += "; per unit (each unit's input kept, one unit re-computed at a time)"
        stages.append(
            StagePlan(
                index=s,
                device=cluster.devices[ranks[s]].name,
                units=units,
                first_module=units[0],
                last_module=units[-1],
                checkpoint=c.checkpoint,
                checkpoint_granularity=c.checkpoint_granularity,
                rank=ranks[s],
                unit_parameters=[counts[u] for u in units] if counts is not None else [],
                # decided here, once: the runtime runs the chunk's backward as recorded
                split_backward=splits_backward(cm.profile, i, j, s, c.checkpoint)
                if split
                else None,
                report=StageReport(
                    forward_s=c.forward_s,
                    backward_s=c.backward_s,
                    recompute_s=c.recompute_s,
                    send_s=c.send_s,
                    memory_bytes=c.memory_bytes,
                    parameter_bytes=c.parameter_bytes,
                    optimizer_bytes=c.optimizer_bytes,
                    activation_bytes=c.activation_bytes,
                    reason=reason,
                    backward_input_s=works[s].backward_input_s if works else 0.0,
                    backward_weight_s=works[s].backward_weight_s if works else 0.0,
                    microbatch_activation_bytes=int(works[s].activation_bytes) if works else 0,
                    microbatch_input_bytes=int(works[s].input_bytes) if works else 0,
                ),
            )
        )
    return stages


def _single_device_s(profile: Profile, cluster: Cluster, batch: int) -> float:
    """Seconds of the whole batch's forward and backward on the first device. O(N)."""
    work_s = sum(
        u.forward_at(batch, profile.batch_size) + u.backward_at(batch, profile.batch_size)
        for u in profile.units
    )
    return work_s / cluster.devices[0].speed


def _notes(
    best: Candidate,
    candidates: list[Candidate],
    stages: list[StagePlan],
    bott: int,
    lower: float,
    gap: float,
) -> list[str]:
    """Why the plan is what it is: its bottleneck, re-materialized stages, M and schedule,
    chunks (V > 1), a traded bottleneck, and the M that do not fit."""
    part = best.partition
    assert part is not None
    sched, v = best.schedule, best.virtual_stages
    times = [c.time_s for c in best.costs]
    what = "chunk" if v > 1 else "stage"
    first, last = stages[bott].first_module, stages[bott].last_module
    span = first if first == last else f"{first} .. {last}"  # never "head .. head"
    notes = [f"bottleneck: {what} {bott} ({span}) at {times[bott] * 1e3:.4g} ms per micro-batch"]
    notes += [f"stage {st.index} {st.reason}" for st in stages if st.reason]
    notes.append(_why_m(best, candidates))
    if v > 1:
        notes.append(
            f"{len(stages) // v} ranks x {v} virtual stages ({sched}); chunks by {best.method}: "
            f"not proven optimal, at most {gap:.1%} above the proven lower bound "
            f"{lower * 1e3:.4g} ms"
        )
    if part.algorithm == "pareto" or (
        part.algorithm.startswith("dp+") and part.algorithm != "dp+moves"
    ):
        traded = times[bott] > best.min_bottleneck_s * (1 + 1e-9)
        what = (
            f"trades the bottleneck ({times[bott] * 1e3:.4g} ms vs the minimum "
            f"{best.min_bottleneck_s * 1e3:.4g} ms)"
            if traded
            else "keeps the minimum bottleneck"
        )
        why = (
            "a smaller max forward + max backward, which is what GPipe's fill-drain time depends on"
            if part.algorithm == "pareto"
            else f"a faster simulated {sched} iteration (the {part.algorithm[3:]} cut)"
        )
        notes.append(f"partition {what} for {why}")
    infeasible = sorted(
        {
            c.microbatches
            for c in candidates
            if not c.feasible and not c.pruned and c.schedule == sched
        }
    )
    if infeasible:
        notes.append(f"M in {infeasible} does not fit in memory with schedule={sched}")
    return notes


def _baselines(best: Candidate, profile: Profile, strategy: str) -> dict[str, dict[str, Any]]:
    """Every other strategy's and framework default's figures at the plan's M."""
    others = [b for b in (*BASELINES, "dp", *FRAMEWORK_DEFAULTS) if b != strategy]
    return {name: _evaluate_baseline(name, best, profile) for name in others}


def _baseline_summary(baselines: dict[str, dict[str, Any]], best: Candidate) -> list[str]:
    """The note comparing the feasible partitioning baselines' iteration times with the
    plan's (the frameworks' defaults get their own table)."""
    it = best.iteration_time_s
    summary = [
        f"{name} {b['iteration_time_s'] / it:.2f}x"
        for name, b in baselines.items()
        if b["feasible"] and name not in FRAMEWORK_DEFAULTS
    ]
    if not summary:
        return []
    return [
        f"iteration time relative to this plan (M={best.microbatches}, {best.schedule}): "
        + ", ".join(summary)
    ]


def _why_m(best: Candidate, candidates: list[Candidate]) -> str:
    m, sched, it = best.microbatches, best.schedule, best.iteration_time_s
    assert best.simulation is not None
    v = best.virtual_stages
    sched = sched if v == 1 else f"{sched} (V={v})"
    text = f"M={m}, schedule={sched}: pipeline iteration {it * 1e3:.4g} ms, bubble {best.simulation.bubble_fraction:.1%}"
    rivals = [c for c in candidates if c.feasible and c is not best]
    if not rivals:
        return text + " (the only feasible candidate)"
    same = sorted(
        (c for c in rivals if c.schedule == best.schedule and c.virtual_stages == v),
        key=lambda c: c.microbatches,
    )
    lower = [c for c in same if c.microbatches < m][-1:]
    higher = [c for c in same if c.microbatches > m][:1]
    parts = [f"M={c.microbatches} {c.iteration_time_s * 1e3:.4g} ms" for c in lower + higher]
    other = [c for c in rivals if c.schedule != best.schedule]
    if other:
        o = min(other, key=lambda c: c.iteration_time_s)
        parts.append(
            f"best {o.schedule} {o.iteration_time_s * 1e3:.4g} ms at M={o.microbatches}, "
            f"V={o.virtual_stages}"
        )
    return text + (" (vs " + ", ".join(parts) + ")" if parts else "")


def _framework_candidate(best: Candidate, profile: Profile, schedule: str, v: int) -> Candidate:
    """``best``'s problem (profile, devices, M, batch, memory rules) under another
    (schedule, V): the one a framework would run. O(N + K V M)."""
    if schedule == best.schedule and v == best.virtual_stages:
        return best
    assert best.shape is not None and best.cluster is not None
    cm = best.cost_model
    shape = ScheduleShape.of(schedule, best.shape.num_ranks, v, best.microbatches)
    other = cost_model_for(
        profile,
        best.cluster,
        shape,
        batch_size=cm.batch_size,
        checkpoint=cm.checkpoint_mode,
        state_bytes_per_parameter=cm.state_factor * max(int(profile.bytes_per_parameter), 1),
        headroom=cm.headroom,
    )
    return Candidate(best.microbatches, schedule, other, shape=shape, cluster=best.cluster)


def _evaluate_baseline(name: str, best: Candidate, profile: Profile) -> dict[str, Any]:
    """A strategy's figures at the plan's M, priced like the plan (chunk costs, simulation,
    replayed memory); infeasible ones carry their memory need. The partitioning baselines
    run at the plan's (schedule, V); a framework's default split at the schedule and stages
    per rank that framework runs (:func:`framework_shape`): torchtitan 1 or 2 stages per
    rank, DeepSpeed its 1F1B on one stage per rank, Megatron only 1F1B / interleaved."""
    cm, m, sched = best.cost_model, best.microbatches, best.schedule
    reason = ""
    cand = best
    if name == "dp":
        part = exact_partition(cm)
        cm.clear_cache()
        bounds = part.bounds if part is not None else None
    elif name in FRAMEWORK_DEFAULTS:
        shape = framework_shape(name, sched, best.virtual_stages)
        if isinstance(shape, str):
            bounds, reason = None, shape
        else:
            sched, v = shape
            assert best.shape is not None
            if best.shape.num_ranks * v > len(profile.units):
                bounds = None
                reason = f"needs {best.shape.num_ranks * v} stages, the model has fewer units"
            else:
                cand = _framework_candidate(best, profile, sched, v)
                assert cand.shape is not None
                bounds, reason = framework_default_bounds(name, profile, cand.shape.num_chunks)
    else:
        bounds = baseline_bounds(name, profile, cm.num_stages)
    if bounds is None:
        return {
            "iteration_time_s": None,
            "bottleneck_s": None,
            "balance": [],
            "feasible": False,
            "reason": reason,
        }
    ev = cand.evaluate(bounds)
    costs = ev.costs
    balance = [bounds[s + 1] - bounds[s] for s in range(len(bounds) - 1)]
    sim = ev.simulation
    return {
        "iteration_time_s": sim.iteration_time_s,
        "bottleneck_s": max(c.time_s for c in costs),
        "balance": balance,
        "feasible": ev.fits,
        "bubble_fraction": sim.bubble_fraction,
        "max_memory_bytes": max(c.memory_bytes for c in costs),
        "microbatches": m,
        "schedule": sched,
        "virtual_stages": cand.virtual_stages,
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
        "checkpoint_granularity": c.checkpoint_granularity,
    }
