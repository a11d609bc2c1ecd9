"""The one error hierarchy: every error autopipe raises on purpose is an ``AutopipeError``.

``UsageError`` (bad input: a flag, a file, a model that cannot be planned as asked) and
``Failure`` (the input was fine, the work could not be done) sit under it; the CLI maps them to
exit codes 2 and 1. The library's own errors derive from one of the two (``PlanFormatError``,
``TraceError``: usage; ``PlanningError``, ``PipelineRankError``: failures; ``RuleViolation``, a
planning error the request caused, is both and exits 2) and keep the builtin base they always
had (``ValueError``, ``RuntimeError``), so ``except ValueError`` still catches them.
"""

from __future__ import annotations

__all__ = ["AutopipeError", "Failure", "UsageError"]


class AutopipeError(Exception):
    """Base of every error autopipe raises on purpose."""


class UsageError(AutopipeError):
    """Bad input from the user: exit 2."""


class Failure(AutopipeError):
    """The input was fine but the work could not be done: exit 1."""
