"""Which torch.distributed.pipelining schedule runs a plan, where its chunks go, and the rules
a plan must follow for torch to accept it. Torch-free.

The seven schedules a plan may name (``autopipe.planner.plan_data.PLAN_SCHEDULES``) are torch
2.13's classes of the same names. Two kinds:

- single-stage (``gpipe``, ``1f1b``): one chunk per rank, ``V = 1``, chunk ``r`` on rank ``r``;
- multi-stage (``interleaved-1f1b``, ``looped-bfs``, ``interleaved-zb``: *loop* placement,
  chunk ``c`` on rank ``c mod K``, any ``V >= 1``; ``zbv``, ``dualpipev``: *V-shape*
  placement, exactly ``V = 2``, rank ``r`` holds chunks ``r`` and ``2K - 1 - r``).

The zero-bubble schedules (``interleaved-zb``, ``zbv``, ``dualpipev``) run each chunk's
backward as two actions, the input gradient (B, sent upstream at once) and the weight
gradient (W, deferred to fill the bubble).

:func:`check_schedule` raises :class:`ScheduleRuleError`, one line naming the rule, for a plan
torch would refuse (or, for M, whose constructor would raise): the runtime calls it before
building anything, so a bad plan fails on every rank at once with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MULTI_STAGE",
    "SCHEDULE_CLASSES",
    "ScheduleRuleError",
    "V_SHAPE",
    "ZERO_BUBBLE",
    "check_schedule",
    "chunk_ranks",
]

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Plan schedule name -> the ``torch.distributed.pipelining`` class that runs it."""

MULTI_STAGE = frozenset({"interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"})
"""Schedules whose class takes the list of a rank's chunks (``PipelineScheduleMulti``)."""

V_SHAPE = frozenset({"zbv", "dualpipev"})
"""Schedules placing chunks in a V (rank ``r``: chunks ``r`` and ``2K - 1 - r``)."""

ZERO_BUBBLE = frozenset({"interleaved-zb", "zbv", "dualpipev"})
"""Schedules that split each chunk's backward into input (B) and weight (W) actions."""

ROUNDS_RULE = frozenset({"interleaved-1f1b", "interleaved-zb"})
"""Schedules that run M in ``max(1, M // K)`` rounds and need M divisible by the rounds."""


class ScheduleRuleError(ValueError):
    """The plan breaks a rule of the schedule it names (one line, naming the rule)."""


def chunk_ranks(schedule: str, num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of each of the ``K x V`` chunks, in model order, as torch places them."""
    chunks = num_ranks * virtual_stages
    if schedule in V_SHAPE:
        # Down the ranks for chunks 0..K-1, back up for K..2K-1 (and so on for larger V).
        return [
            c % num_ranks if (c // num_ranks) % 2 == 0 else num_ranks - 1 - c % num_ranks
            for c in range(chunks)
        ]
    return [c % num_ranks for c in range(chunks)]


def check_schedule(
    schedule: str,
    num_ranks: int,
    virtual_stages: int,
    microbatches: int,
    ranks: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> None:
    """Raise :class:`ScheduleRuleError` unless torch 2.13 runs ``schedule`` with K =
    ``num_ranks`` ranks, V = ``virtual_stages`` chunks per rank and M = ``microbatches``,
    ``ranks`` (each chunk's rank, model order; None: not checked) is torch's placement and
    the batch of ``batch_size`` samples (None: not checked) has at least M.

    The rules, as the schedule classes enforce them:

    - the schedule is one of :data:`SCHEDULE_CLASSES`;
    - ``gpipe`` and ``1f1b`` run one chunk per rank (V = 1);
    - ``zbv`` and ``dualpipev`` run exactly 2 chunks per rank (V = 2);
    - chunk ``c`` is on rank ``c mod K`` (loop), or on the V-shape's rank for ``zbv`` and
      ``dualpipev``;
    - ``1f1b``: M >= K; ``dualpipev``: M >= K x V (its stage count is the chunk count);
    - ``interleaved-1f1b`` and ``interleaved-zb``: M divisible by its rounds ``max(1, M // K)``;
    - batch >= M (each micro-batch holds a sample).

    The runtime never compiles a stage (``torch.compile``), so the zero-bubble schedules'
    "no compiled stages" rule holds by construction. O(K x V).
    """
    K, V, M = num_ranks, virtual_stages, microbatches
    if schedule not in SCHEDULE_CLASSES:
        raise ScheduleRuleError(
            f"schedule {schedule!r} is not one of {', '.join(SCHEDULE_CLASSES)}"
        )
    if K < 1 or V < 1 or M < 1:
        raise ScheduleRuleError(f"need K, V, M >= 1, got K={K}, V={V}, M={M}")
    if schedule not in MULTI_STAGE and V != 1:
        raise ScheduleRuleError(
            f"{schedule} runs one chunk per rank but the plan has {V} virtual stages per rank "
            "(rule: V = 1); use interleaved-1f1b, looped-bfs or interleaved-zb for V > 1"
        )
    if schedule in V_SHAPE and V != 2:
        raise ScheduleRuleError(
            f"{schedule} needs exactly 2 chunks per rank but the plan has {V} "
            "(rule: V = 2 for zbv and dualpipev)"
        )
    if ranks is not None:
        expected = chunk_ranks(schedule, K, V)
        if len(ranks) != len(expected):
            raise ScheduleRuleError(
                f"the plan lists {len(ranks)} chunks but K x V = {K} x {V} = {len(expected)}"
            )
        for c, (got, want) in enumerate(zip(ranks, expected, strict=True)):
            if got != want:
                placement = (
                    "rank r holds chunks r and 2K-1-r"
                    if schedule in V_SHAPE
                    else "chunk c on rank c mod K"
                )
                raise ScheduleRuleError(
                    f"chunk {c} is on rank {got} but {schedule} places it on rank {want} "
                    f"(rule: {placement})"
                )
    if schedule == "1f1b" and M < K:
        raise ScheduleRuleError(
            f"1f1b needs at least as many micro-batches as ranks, got M={M} for K={K} "
            "(rule: M >= K)"
        )
    if schedule == "dualpipev" and M < K * V:
        raise ScheduleRuleError(
            f"dualpipev needs at least as many micro-batches as chunks, got M={M} for "
            f"K x V = {K * V} (rule: M >= 2K)"
        )
    if batch_size is not None and batch_size < M:
        raise ScheduleRuleError(
            f"a batch of {batch_size} samples cannot make M={M} micro-batches (rule: batch >= M)"
        )
    if schedule in ROUNDS_RULE:
        rounds = max(1, M // K)
        if M % rounds:
            raise ScheduleRuleError(
                f"{schedule} runs M={M} micro-batches in max(1, M // K) = {rounds} rounds, "
                f"which do not divide it (rule: M % max(1, M // K) == 0)"
            )
