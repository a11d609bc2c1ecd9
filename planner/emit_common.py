"""What every emitter shares: its one error and the plan facts each reads. Torch-free."""

from __future__ import annotations

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan

__all__ = ["EmitError", "checkpointed", "checkpointed_per_stage", "require_schedule"]


class EmitError(UsageError, ValueError):
    """The plan uses something the target framework cannot express."""


def require_schedule(plan: Plan, table: dict[str, str], target: str) -> str:
    """``target``'s name for the plan's schedule, or :class:`EmitError` when it has none."""
    name = table.get(plan.schedule)
    if name is None:
        raise EmitError(f"{target} has no schedule for autopipe's {plan.schedule!r}")
    return name


def checkpointed(plan: Plan) -> list[int]:
    """The indices of the chunks the plan re-materializes."""
    return [s.index for s in plan.stages if s.checkpoint]


def checkpointed_per_stage(plan: Plan) -> list[int]:
    """The indices of the chunks the plan re-materializes whole (``checkpoint_granularity``
    ``"stage"``: the chunk's input kept, the whole chunk re-computed at once)."""
    return [s.index for s in plan.stages if s.checkpoint and s.checkpoint_granularity != "unit"]
