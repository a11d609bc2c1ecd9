"""The one error hierarchy: every error autopipe raises on purpose is an ``AutopipeError``.

``UsageError`` (bad input: a flag, a file, a model that cannot be planned as asked) and
``Failure`` (the input was fine, the work could not be done) sit under it; the CLI maps them to
exit codes 2 and 1. The library's own errors (``PlanFormatError``, ``PlanningError``,
``TraceError`` ...) derive from ``AutopipeError`` and keep the builtin base they always had
(``ValueError``, ``RuntimeError``), so ``except ValueError`` still catches them; the commands
say which of the two each one is where they catch it.
"""

from __future__ import annotations

__all__ = ["AutopipeError", "Failure", "UsageError"]


class AutopipeError(Exception):
    """Base of every error autopipe raises on purpose."""


class UsageError(AutopipeError):
    """Bad input from the user: exit 2."""


class Failure(AutopipeError):
    """The input was fine but the work could not be done: exit 1."""
