"""autopipe: automatic GPipe-style pipeline parallelism for PyTorch.

``profile`` (model -> Profile), ``plan`` (Profile -> Plan), ``parallelize`` and ``GPipe``
(model + Plan -> running pipeline). Names are resolved lazily so that
``import autopipe.planner`` never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "profile": ("autopipe.profiler.measure", "profile"),
    "Profile": ("autopipe.profiler.profile", "Profile"),
    "UnitProfile": ("autopipe.profiler.profile", "UnitProfile"),
    "load_profile": ("autopipe.profiler", "load_profile"),
    "plan": ("autopipe.planner", "plan"),
    "Plan": ("autopipe.planner.plan", "Plan"),
    "StagePlan": ("autopipe.planner.plan", "StagePlan"),
    "load_plan": ("autopipe.planner.plan", "load_plan"),
    "Cluster": ("autopipe.planner.cluster", "Cluster"),
    "Device": ("autopipe.planner.cluster", "Device"),
    "PlanningError": ("autopipe.planner", "PlanningError"),
    "parallelize": ("autopipe.runtime", "parallelize"),
    "Pipeline": ("autopipe.runtime", "Pipeline"),
    "GPipe": ("autopipe.runtime", "GPipe"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autopipe' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
