"""Re-materialization in the planner's words, and the per-stage flags the runtime runs.

Torch-free. The planner decides re-materialization *per stage* (every micro-batch of a
checkpointed stage keeps only its input and recomputes its forward in backward):

- ``"never"`` / ``"always"``: no stage / every stage;
- ``"except_last"``: every stage but the last (its backward follows its forward at once);
- ``"auto"``: a stage only where its activations would not fit (``Plan.stages[i].checkpoint``).

A checkpointed stage is re-materialized whole or one unit at a time
(``StagePlan.checkpoint_granularity``, ``autopipe.core.vocabulary.CHECKPOINT_GRANULARITIES``),
whichever the cost model finds needs less memory (``planner/costs.py``).

``parallelize`` turns a mode and a plan's flags into the list of booleans, one per stage,
that the runtimes take with the plan's granularities. torchgpipe's words (where
``except_last`` means every *micro-batch* but the last) are translated by
``autopipe.runtime.gpipe`` alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopipe.core.vocabulary import CHECKPOINT_MODES

__all__ = ["check_checkpoint_mode", "stage_checkpoints"]


def check_checkpoint_mode(mode: str) -> None:
    """``ValueError`` naming the modes unless ``mode`` is one of :data:`CHECKPOINT_MODES`."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint is not one of {', '.join(map(repr, CHECKPOINT_MODES))}: got {mode!r}"
        )


def stage_checkpoints(mode: str, planned: Sequence[bool]) -> list[bool]:
    """One flag per stage: the plan's own choice (``planned``) for ``"auto"``, else the
    mode's. O(stages)."""
    check_checkpoint_mode(mode)
    k = len(planned)
    if mode == "auto":
        return [bool(flag) for flag in planned]
    if mode == "always":
        return [True] * k
    if mode == "never":
        return [False] * k
    return [True] * (k - 1) + [False]  # except_last: every stage but the last
