"""Choose pipeline depth K and data-parallel degree D for G devices (G = K x D). Torch-free.

For every divisor K of G, a plan for K stages at the per-replica batch ``B / D`` comes from the
caller's planner callable; the step time is that plan's pipeline iteration plus the gradient
all-reduce among the D replicas of the largest stage, which the distributed runtime runs after
the pipeline drains (not overlapped), modelled as a ring all-reduce::

    allreduce_s = 2 (D - 1) / D * stage_gradient_bytes / bandwidth + 2 (D - 1) * latency

(each rank sends and receives ``(D - 1) / D`` of the buffer twice: reduce-scatter then
all-gather). Throughput is ``B / step_s``. Cost: one planner call per divisor of G.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from autopipe.planner.errors import PlanningError
from autopipe.planner.planning import plan
from autopipe.planner.search import divisor_hint, divisors

from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan
from autopipe.core.plan_records import DataParallelRow
from autopipe.core.profile import Profile
from autopipe.core.request import PlanRequest


@dataclass
class ParallelChoice:
    """One (K, D) candidate and its modelled step."""

    stages: int
    """K: pipeline stages."""
    replicas: int
    """D: copies of each stage."""
    plan: Plan | None
    """The K-stage plan at batch ``B / D`` (None if infeasible)."""
    pipeline_s: float = float("inf")
    allreduce_s: float = float("inf")
    step_s: float = float("inf")
    throughput: float = 0.0
    """Samples per second over the global batch."""
    reason: str = ""
    """Why the candidate is infeasible ("" if feasible)."""


def ring_allreduce_s(
    nbytes: float, replicas: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` among ``replicas`` ranks (0 for one rank)."""
    if replicas <= 1:
        return 0.0
    return (
        2 * (replicas - 1) / replicas * nbytes / bandwidth_bytes_per_s
        + 2 * (replicas - 1) * latency_s
    )


def choose_pipeline_data_parallel(
    make_plan: Callable[[int, int], Plan],
    total_devices: int,
    batch_size: int,
    allreduce_bandwidth_bytes_per_s: float,
    allreduce_latency_s: float = 0.0,
    replicas: int | None = None,
) -> list[ParallelChoice]:
    """All (K, D) with ``K x D = total_devices``, best (highest throughput) first.

    ``replicas`` fixes D: then the one K = ``total_devices / D`` is tried (and reported).

    ``make_plan(K, per_replica_batch)`` returns a Plan (e.g. ``lambda k, b: plan(profile,
    gpus=k, batch_size=b)``) or raises (any exception marks that K infeasible, its message kept
    in ``reason``). Gradient bytes per stage are the plan's ``StagePlan.parameter_bytes``
    (gradients have the parameters' size and dtype). ``batch_size`` is the global batch; D must
    divide it. Raises ``ValueError`` if no candidate is feasible, naming each one's reason.
    """
    if total_devices < 1 or batch_size < 1:
        raise ValueError("total_devices and batch_size must be positive")
    if allreduce_bandwidth_bytes_per_s <= 0:
        raise ValueError("allreduce_bandwidth_bytes_per_s must be positive")
    choices: list[ParallelChoice] = []
    for stages in divisors(total_devices):
        copies = total_devices // stages
        if replicas is not None and copies != replicas:
            continue
        choices.append(
            _candidate(
                make_plan,
                stages,
                copies,
                batch_size,
                allreduce_bandwidth_bytes_per_s,
                allreduce_latency_s,
            )
        )
    feasible = [c for c in choices if c.plan is not None]
    if not feasible:
        raise ValueError(
            f"no K x D split of {total_devices} devices works: "
            + "; ".join(f"K={c.stages}: {c.reason}" for c in choices)
        )
    return sorted(choices, key=lambda c: (-c.throughput, c.stages))


def _candidate(
    make_plan: Callable[[int, int], Plan],
    stages: int,
    copies: int,
    batch_size: int,
    allreduce_bandwidth_bytes_per_s: float,
    allreduce_latency_s: float,
) -> ParallelChoice:
    """K = ``stages`` run by D = ``copies`` replicas: planned at ``batch_size / D`` and
    priced with the all-reduce, or infeasible with the reason."""
    if batch_size % copies:
        return ParallelChoice(
            stages, copies, None, reason=f"batch {batch_size} not divisible by D={copies}"
        )
    try:
        plan = make_plan(stages, batch_size // copies)
    except Exception as exc:  # the planner says this K cannot work
        return ParallelChoice(stages, copies, None, reason=str(exc).splitlines()[0])
    # A rank all-reduces the gradients of all its chunks (V of them with virtual stages).
    per_rank = [0] * plan.num_stages
    for i, s in enumerate(plan.stages):
        per_rank[s.rank if s.rank >= 0 else i] += s.parameter_bytes
    allreduce_s = max(
        ring_allreduce_s(b, copies, allreduce_bandwidth_bytes_per_s, allreduce_latency_s)
        for b in per_rank
    )
    step_s = plan.iteration_time_s + allreduce_s
    return ParallelChoice(
        stages,
        copies,
        plan,
        pipeline_s=plan.iteration_time_s,
        allreduce_s=allreduce_s,
        step_s=step_s,
        throughput=batch_size / step_s if step_s > 0 else float("inf"),
    )


def check_replicas_divide_batch(replicas: int, total_gpus: int, batch_size: int) -> None:
    """PlanningError in one line unless D = ``replicas`` divides the global ``batch_size``
    (each replica pipelines ``batch_size / D`` samples), naming the D that would."""
    if batch_size % replicas == 0:
        return
    raise PlanningError(
        f"D={replicas} replicas do not divide the batch size {batch_size} (each replica "
        f"pipelines batch / D samples): for D, "
        + divisor_hint(math.gcd(total_gpus, batch_size), replicas)
        + f" of both {total_gpus} GPUs and the batch, or auto"
    )


def plan_data_parallel(
    profile: Profile,
    total_gpus: int,
    request: PlanRequest | None = None,
    *,
    replicas: int | str = "auto",
    allreduce_bandwidth_bytes_per_s: float,
    allreduce_latency_s: float = 0.0,
    device: Device | None = None,
) -> Plan:
    """The best ``K x D = total_gpus`` layout: a K-stage plan of ``request`` run by D
    data-parallel replicas.

    ``replicas="auto"`` tries every divisor D of ``total_gpus`` (one planner call each) and
    keeps the highest modelled throughput; an integer fixes D. The request's ``batch_size``
    is the global batch (default: the profile's); each replica pipelines ``batch_size / D``
    samples; its ``gpus`` and ``cluster`` are replaced by each K: ``device`` is repeated K
    times (default: the profile's device with the request's ``memory_per_device``). The
    returned Plan has ``replicas = D``, its per-replica ``batch_size``, ``iteration_time_s`` =
    pipeline + all-reduce, ``throughput`` over the global batch, and every candidate in
    ``Plan.data_parallel``. Raises ``PlanningError``.
    """
    _check_layout(total_gpus, replicas)
    request = PlanRequest() if request is None else request
    batch = profile.batch_size if request.batch_size is None else request.batch_size
    fixed = None if replicas == "auto" else int(replicas)
    if fixed is not None:
        check_replicas_divide_batch(fixed, total_gpus, batch)
    try:
        choices = choose_pipeline_data_parallel(
            _replica_planner(profile, request, device),
            total_gpus,
            batch,
            allreduce_bandwidth_bytes_per_s,
            allreduce_latency_s,
            replicas=fixed,
        )
    except ValueError as exc:
        raise PlanningError(str(exc)) from exc
    best = choices[0]
    assert best.plan is not None
    out = best.plan
    _record_choice(out, best)
    _baselines_pay_allreduce(
        out, best.replicas, allreduce_bandwidth_bytes_per_s, allreduce_latency_s
    )
    out.data_parallel = [_data_parallel_row(c) for c in choices]
    out.notes.append(
        f"{best.stages} stages x {best.replicas} replicas of {total_gpus} GPUs: pipeline "
        f"{best.pipeline_s * 1e3:.4g} ms + gradient all-reduce {best.allreduce_s * 1e3:.4g} ms "
        f"per step, {best.throughput:.4g} samples/s over the global batch of {batch}"
    )
    return out


def _check_layout(total_gpus: int, replicas: int | str) -> None:
    """PlanningError unless ``total_gpus`` >= 1 and ``replicas`` is 'auto' or divides it."""
    if total_gpus < 1:
        raise PlanningError(f"total_gpus={total_gpus} must be a positive integer")
    if replicas != "auto" and (
        not isinstance(replicas, int) or replicas < 1 or total_gpus % replicas
    ):
        raise PlanningError(
            f"replicas={replicas!r} must be 'auto' or a divisor of the {total_gpus} GPUs"
        )


def _replica_planner(
    profile: Profile, request: PlanRequest, device: Device | None
) -> Callable[[int, int], Plan]:
    """The planner callable for ``choose_pipeline_data_parallel``: ``request`` on K stages
    (``device`` repeated K times, else K of the request's own) at the per-replica batch."""

    def make_plan(stages: int, per_replica_batch: int) -> Plan:
        if stages > len(profile.units):
            raise PlanningError(f"{stages} stages need at least {stages} units")
        cluster = None if device is None else Cluster([device] * stages)
        gpus = stages if device is None else None
        asked = dataclasses.replace(
            request, gpus=gpus, cluster=cluster, batch_size=per_replica_batch
        )
        return plan(profile, asked)

    return make_plan


def _record_choice(out: Plan, best: ParallelChoice) -> None:
    """The chosen layout's D, step (pipeline + all-reduce) and throughput on its plan."""
    out.replicas = best.replicas
    out.pipeline_iteration_s = best.pipeline_s
    out.allreduce_s = best.allreduce_s
    out.iteration_time_s = best.step_s
    out.throughput = best.throughput
    # One device would take D times the per-replica single-device time for the global batch.
    out.speedup *= best.replicas * best.pipeline_s / best.step_s


def _baselines_pay_allreduce(
    out: Plan, replicas: int, bandwidth_bytes_per_s: float, latency_s: float
) -> None:
    """Baselines run with the same D, so they pay the all-reduce of their own largest stage."""
    for base in out.baselines.values():
        if base.get("feasible") and base.get("stages"):
            base["iteration_time_s"] += max(
                ring_allreduce_s(s["parameter_bytes"], replicas, bandwidth_bytes_per_s, latency_s)
                for s in base["stages"]
            )


def _data_parallel_row(c: ParallelChoice) -> DataParallelRow:
    """One candidate (K, D) as the Plan records it (no step for an infeasible one)."""
    return DataParallelRow(
        stages=c.stages,
        replicas=c.replicas,
        step_s=c.step_s if c.plan is not None else None,
        allreduce_s=c.allreduce_s if c.plan is not None else None,
        throughput=c.throughput,
        reason=c.reason,
    )
