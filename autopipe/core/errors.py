"""The one error hierarchy: every error autopipe raises on purpose is an ``AutopipeError``.

``UsageError`` (bad input: a flag, a file, a model that cannot be planned as asked) and
``Failure`` (the input was fine, the work could not be done) sit under it; the CLI maps them to
exit codes 2 and 1. The library's own errors derive from one of the two (``PlanFormatError``,
``TraceError``: usage; ``PlanningError``, ``PipelineRankError``: failures; ``RuleViolation``, a
planning error the request caused, is both and exits 2) and keep the builtin base they always
had (``ValueError``, ``RuntimeError``), so ``except ValueError`` still catches them.
"""

from __future__ import annotations

__all__ = ["AutopipeError", "Failure", "PlanningError", "RuleViolation", "UsageError"]


class AutopipeError(Exception):
    """Base of every error autopipe raises on purpose."""


class UsageError(AutopipeError):
    """Bad input from the user: exit 2."""


class Failure(AutopipeError):
    """The input was fine but the work could not be done: exit 1."""


class PlanningError(Failure, ValueError):
    """No plan can be made from these inputs; the message is one line saying why and what to try.

    When memory is the reason, ``min_memory_bytes`` is the smallest equal memory per device
    (bytes, headroom included) for which the same request has a plan; otherwise it is None.
    Defined here (re-exported by ``autopipe.planner.errors``) so that ``PlanRequest`` can
    refuse a bad field at construction with the planner's own error.
    """

    min_memory_bytes: int | None = None


class RuleViolation(PlanningError, UsageError):
    """The request forces a plan that torch.distributed.pipelining would refuse to run (a
    rule of :mod:`autopipe.core.schedule_rules`, named at the start of the message), or a
    request field is invalid (``PlanRequest``): bad input rather than a planning failure (a
    ``UsageError`` too), so the CLI exits 2."""
