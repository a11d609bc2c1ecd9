"""The planner's exception types. Torch-free."""

from __future__ import annotations

from autopipe.core.errors import Failure, UsageError


class PlanningError(Failure, ValueError):
    """No plan can be made from these inputs; the message is one line saying why and what to try.

    When memory is the reason, ``min_memory_bytes`` is the smallest equal memory per device
    (bytes, headroom included) for which the same request has a plan; otherwise it is None.
    """

    min_memory_bytes: int | None = None


class RuleViolation(PlanningError, UsageError):
    """The request forces a plan that torch.distributed.pipelining would refuse to run (a
    rule of :mod:`autopipe.planner.preflight`, named at the start of the message): bad
    input rather than a planning failure (a ``UsageError`` too), so the CLI exits 2."""
