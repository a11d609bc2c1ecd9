"""The planner's one exception type. Torch-free."""

from __future__ import annotations


class PlanningError(ValueError):
    """No plan can be made from these inputs; the message is one line saying why and what to try."""
