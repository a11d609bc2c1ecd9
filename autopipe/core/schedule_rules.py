"""What torch.distributed.pipelining (2.13) requires of a plan's schedule: how many chunks
each rank holds (:func:`check_virtual_stages`), where each chunk runs (:func:`chunk_ranks`:
loop placement, chunk ``c`` on rank ``c mod K``; V-shape, rank ``r`` holds chunks ``r`` and
``2K - 1 - r``), and the rules its constructors enforce (:func:`violations`,
:func:`preflight`). Torch-free: the planner skips and refuses what breaks them, and every
rank of the runtime checks its plan against them before building anything.

Each violation is one line that starts with the rule's name. The rules, and the torch code
that enforces each (``torch/distributed/pipelining/schedules.py``):

- ``stages-per-rank``: GPipe and 1F1B run one stage per rank (``PipelineScheduleSingle``
  takes one stage); ZBV and DualPipeV exactly two ("ZBV requires exactly 2 stages per
  rank", raised by both constructors); the looped schedules take any number.
- ``microbatches-vs-stages``: ``Schedule1F1B`` and ``ScheduleDualPipeV`` refuse fewer
  micro-batches than pipeline stages (``n_microbatches < num_stages``, where ``num_stages``
  counts every stage of the pipeline: K for 1F1B, 2K for DualPipeV).
- ``rounds``: ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` run
  micro-batches in ``max(1, M // K)`` rounds and refuse an M that is not a multiple of it
  (``ScheduleLoopedBFS`` and ``ScheduleZBVZeroBubble`` have no such rule).
- ``batch-vs-microbatches``: every micro-batch needs at least one sample, and autopipe cuts
  the batch into M equal micro-batches (``batch % M == 0``).
- ``no-compile-with-zero-bubble``: the schedules that split backward into input and weight
  gradients (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
  ``ScheduleDualPipeV``) refuse stages that contain a ``torch.compile``'d module.
- ``placement``: each chunk on the rank torch's schedule places it (loop or V-shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.core.vocabulary import (
    SINGLE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    TORCH_CLASSES,
    V_SHAPE_SCHEDULES,
)

if TYPE_CHECKING:  # annotations only: PlanRequest checks V with these rules at construction
    from autopipe.core.plan import Plan

__all__ = ["RULES", "check_virtual_stages", "chunk_ranks", "preflight", "violations"]

RULES = (
    "stages-per-rank",
    "microbatches-vs-stages",
    "rounds",
    "batch-vs-microbatches",
    "no-compile-with-zero-bubble",
    "placement",
)


def check_virtual_stages(schedule: str, virtual_stages: int) -> str | None:
    """Why ``schedule`` cannot run ``virtual_stages`` chunks per rank (one line), or None."""
    if schedule not in TORCH_CLASSES:
        return f"unknown schedule {schedule!r}; use one of {', '.join(TORCH_CLASSES)}"
    if virtual_stages < 1:
        return f"virtual_stages={virtual_stages} must be at least 1"
    if schedule in SINGLE_SCHEDULES and virtual_stages != 1:
        return f"{schedule} runs one stage per rank (virtual_stages=1), not {virtual_stages}"
    if schedule in V_SHAPE_SCHEDULES and virtual_stages != 2:
        return f"{schedule} runs exactly 2 stages per rank (virtual_stages=2), not {virtual_stages}"
    return None


def chunk_ranks(schedule: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of each of the ``K x V`` chunks, in model order. O(K V)."""
    why = check_virtual_stages(schedule, virtual_stages)
    if why is not None:
        raise ValueError(why)
    k = num_ranks
    chunks = k * virtual_stages
    if schedule in V_SHAPE_SCHEDULES:
        return [c if c < k else 2 * k - 1 - c for c in range(chunks)]
    return [c % k for c in range(chunks)]


def violations(
    schedule: str,
    num_ranks: int,
    virtual_stages: int,
    microbatches: int,
    batch_size: int,
    *,
    compile: bool = False,
) -> list[str]:
    """The rules a (schedule, K, V, M, batch, compile) breaks, one line each ([]: none). O(1)."""
    out: list[str] = []
    cls = TORCH_CLASSES.get(schedule, schedule)
    k, v, m = num_ranks, virtual_stages, microbatches
    why = check_virtual_stages(schedule, v)
    if why is not None:
        return [f"stages-per-rank: {cls}: {why}"]
    if schedule in ("1f1b", "dualpipev"):
        stages = k * v
        if m < stages:
            out.append(
                f"microbatches-vs-stages: {cls} needs at least as many micro-batches as "
                f"pipeline stages, M >= {stages} ({k} ranks x {v}), got M={m}"
            )
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        rounds = max(1, m // k)
        if m % rounds:
            out.append(
                f"rounds: {cls} runs M in max(1, M // K) = {rounds} rounds and needs "
                f"M % {rounds} == 0, got M={m} with K={k}"
            )
    if m > batch_size:
        out.append(
            f"batch-vs-microbatches: M={m} micro-batches need a batch of at least {m} "
            f"samples, got {batch_size}"
        )
    elif batch_size % m:
        out.append(
            f"batch-vs-microbatches: M={m} does not divide the batch of {batch_size} into "
            "equal micro-batches"
        )
    if compile and schedule in SPLIT_BACKWARD_SCHEDULES:
        out.append(
            f"no-compile-with-zero-bubble: {cls} splits backward into input and weight "
            "gradients, which torch does not support for torch.compile'd stages"
        )
    return out


def preflight(plan: Plan) -> list[str]:
    """Every rule ``plan`` breaks, one line each ([]: torch will build its schedule). The
    compile flag is the plan's trainer option (``plan.trainer.compile``). O(K V)."""
    compiled = plan.trainer.compile
    out = violations(
        plan.schedule,
        plan.num_stages,
        plan.virtual_stages,
        plan.microbatches,
        plan.batch_size,
        compile=compiled,
    )
    if out and out[0].startswith("stages-per-rank"):
        return out
    expected = chunk_ranks(plan.schedule, plan.num_stages, plan.virtual_stages)
    got = [s.rank if s.rank >= 0 else s.index for s in plan.stages]
    if got != expected:
        out.append(
            f"placement: {TORCH_CLASSES[plan.schedule]} places chunks on ranks {expected}, "
            f"the plan on {got}"
        )
    return out
