"""Data parallelism beside a pipeline: G devices as K stages x D replicas (G = K x D).
Torch-free.

:func:`plan_data_parallel` plans it on the one route every data-parallel request takes, the
mesh search with T = 1 and unsharded state (:func:`autopipe.planner.mesh.plan_mesh`): its step
is the pipeline iteration plus the gradient all-reduce among the D replicas of the busiest
rank, run after the pipeline drains (not overlapped), and the optimizer step after it
(:func:`autopipe.planner.mesh.optimizer_exposed_s`); the all-reduce is priced as NCCL would
run it (``Topology.all_reduce_s``: its ring or, across nodes, its tree), and the speedup is
over one device running the whole global batch. :func:`choose_pipeline_data_parallel` weighs
(K, D) for any planner callable (the distributed benchmark's model of a measured step, with a
plain ring all-reduce, :func:`ring_allreduce_s`::

    allreduce_s = 2 (D - 1) / D * stage_gradient_bytes / bandwidth + 2 (D - 1) * latency

each rank sending and receiving ``(D - 1) / D`` of the buffer twice: reduce-scatter then
all-gather); no planning entry point uses it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from autopipe.planner.errors import PlanningError
from autopipe.planner.mesh_costs import ring_collective_s
from autopipe.planner.planning import plan
from autopipe.planner.search import divisor_hint, divisors

from autopipe.core.cluster import Cluster, Device
from autopipe.core.plan import Plan
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
    # a reduce-scatter then an all-gather: the mesh search's own collective model
    return 2 * ring_collective_s(nbytes, replicas, bandwidth_bytes_per_s, latency_s)


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
    data-parallel replicas, from the one data-parallel route, the mesh search with T = 1
    and unsharded state (:func:`autopipe.planner.mesh.plan_mesh`; the same plan as
    ``plan(profile, PlanRequest(data_parallel=D, ...))`` on these devices).

    ``replicas="auto"`` weighs every divisor D of ``total_gpus``; an integer fixes D. The
    request's ``batch_size`` is the global batch (default: the profile's); each replica
    pipelines ``batch_size / D`` samples. The ``total_gpus`` devices are ``device`` (default:
    the profile's device with the request's ``memory_per_device``) with the link
    ``allreduce_bandwidth_bytes_per_s`` / ``allreduce_latency_s``: the gradient all-reduce
    and the pipeline's sends both cross it. The returned Plan has ``data_parallel = D``, its
    per-replica ``batch_size``, ``iteration_time_s`` = pipeline + all-reduce, ``throughput``
    and ``speedup`` over the global batch, and every (K, D) weighed in ``Plan.mesh``. Raises
    ``PlanningError``.
    """
    _check_layout(total_gpus, replicas)
    request = PlanRequest() if request is None else request
    batch = profile.batch_size if request.batch_size is None else request.batch_size
    if replicas != "auto":
        check_replicas_divide_batch(int(replicas), total_gpus, batch)
    if allreduce_bandwidth_bytes_per_s <= 0:
        raise PlanningError("allreduce_bandwidth_bytes_per_s must be positive")
    template = device or Device(profile.device, request.memory_per_device)
    linked = dataclasses.replace(
        template,
        link_bandwidth_bytes_per_s=allreduce_bandwidth_bytes_per_s,
        link_latency_s=allreduce_latency_s,
    )
    asked = dataclasses.replace(
        request,
        gpus=None,
        cluster=Cluster([linked] * total_gpus),
        data_parallel=replicas,
        tensor_parallel=1,
        shard="none",
        context_parallel=1,
        expert_parallel=1,
    )
    return plan(profile, asked)


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
