"""The planner's exception types, and :func:`check_plan`, which raises the one for a plan
breaking a schedule rule. Torch-free."""

from __future__ import annotations

from autopipe.core.errors import PlanningError as PlanningError  # defined in core: PlanRequest
from autopipe.core.errors import RuleViolation as RuleViolation  # raises them too
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import preflight

__all__ = ["check_plan"]  # PlanningError, RuleViolation: autopipe.core.errors


def check_plan(plan: Plan) -> None:
    """Raise :class:`RuleViolation` (a ``PlanningError``) with the first rule ``plan``
    breaks (:func:`autopipe.core.schedule_rules.preflight`), naming how many more there
    are."""
    problems = preflight(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RuleViolation(problems[0] + more)
