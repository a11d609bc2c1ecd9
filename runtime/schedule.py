"""The GPipe fill-drain schedule as clock cycles.

With ``M`` micro-batches and ``K`` stages, forward task ``(i, j)`` (micro-batch ``i`` on
stage ``j``) runs at clock ``i + j``; all tasks of one clock are independent (each needs
only ``(i, j - 1)`` from the previous clock), so stages on different devices run them at
the same time. There are ``M + K - 1`` clocks; the idle ("bubble") fraction of an ideal run
is ``(K - 1) / (M + K - 1)`` (:func:`autopipe.planner.simulate.fill_drain_bubble`).
Backward runs the same clocks in reverse. Cost: O(M K).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["clock_cycles"]


def clock_cycles(num_microbatches: int, num_stages: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per clock, the ``(microbatch, stage)`` tasks that run in it, stage ascending."""
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError(
            f"need at least one micro-batch and one stage, got {num_microbatches} and {num_stages}"
        )
    for clock in range(num_microbatches + num_stages - 1):
        first_stage = max(0, clock - num_microbatches + 1)
        last_stage = min(clock, num_stages - 1)
        yield [(clock - j, j) for j in range(first_stage, last_stage + 1)]
