"""The planner's exception types, and :func:`check_plan`, which raises the one for a plan
breaking a schedule rule. Torch-free."""

from __future__ import annotations

from autopipe.core.errors import Failure, UsageError
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import preflight

__all__ = ["PlanningError", "RuleViolation", "check_plan"]


class PlanningError(Failure, ValueError):
    """No plan can be made from these inputs; the message is one line saying why and what to try.

    When memory is the reason, ``min_memory_bytes`` is the smallest equal memory per device
    (bytes, headroom included) for which the same request has a plan; otherwise it is None.
    """

    min_memory_bytes: int | None = None


class RuleViolation(PlanningError, UsageError):
    """The request forces a plan that torch.distributed.pipelining would refuse to run (a
    rule of :mod:`autopipe.core.schedule_rules`, named at the start of the message): bad
    input rather than a planning failure (a ``UsageError`` too), so the CLI exits 2."""


def check_plan(plan: Plan) -> None:
    """Raise :class:`RuleViolation` (a ``PlanningError``) with the first rule ``plan``
    breaks (:func:`autopipe.core.schedule_rules.preflight`), naming how many more there
    are."""
    problems = preflight(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RuleViolation(problems[0] + more)
