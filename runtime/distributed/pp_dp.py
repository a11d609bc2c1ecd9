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

from collections.abc import Callable
from dataclasses import dataclass

from autopipe.planner.plan import Plan


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
) -> list[ParallelChoice]:
    """All (K, D) with ``K x D = total_devices``, best (highest throughput) first.

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
    for stages in range(1, total_devices + 1):
        if total_devices % stages:
            continue
        replicas = total_devices // stages
        if batch_size % replicas:
            choices.append(
                ParallelChoice(
                    stages,
                    replicas,
                    None,
                    reason=f"batch {batch_size} not divisible by D={replicas}",
                )
            )
            continue
        try:
            plan = make_plan(stages, batch_size // replicas)
        except Exception as exc:  # the planner says this K cannot work
            choices.append(ParallelChoice(stages, replicas, None, reason=str(exc).splitlines()[0]))
            continue
        allreduce_s = max(
            ring_allreduce_s(
                s.parameter_bytes, replicas, allreduce_bandwidth_bytes_per_s, allreduce_latency_s
            )
            for s in plan.stages
        )
        step_s = plan.iteration_time_s + allreduce_s
        choices.append(
            ParallelChoice(
                stages,
                replicas,
                plan,
                pipeline_s=plan.iteration_time_s,
                allreduce_s=allreduce_s,
                step_s=step_s,
                throughput=batch_size / step_s if step_s > 0 else float("inf"),
            )
        )
    feasible = [c for c in choices if c.plan is not None]
    if not feasible:
        raise ValueError(
            f"no K x D split of {total_devices} devices works: "
            + "; ".join(f"K={c.stages}: {c.reason}" for c in choices)
        )
    return sorted(choices, key=lambda c: (-c.throughput, c.stages))
