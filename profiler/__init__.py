"""autopipe.profiler: model -> Profile (per-unit time and memory).

Imports torch only when a profiling function is used, so the torch-free
``autopipe.profiler.profile`` data module stays importable by the planner.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopipe.profiler.profile import PROFILE_VERSION, Profile, ProfileFormatError, UnitProfile

# ``autopipe.profiler.profile`` is the data module (Profile); the measuring function is
# ``autopipe.profile`` / ``autopipe.profiler.measure.profile``.
_LAZY = {
    "profile_analytic": ("autopipe.profiler.analytic", "profile_analytic"),
    "trace_units": ("autopipe.profiler.units", "trace_units"),
}

__all__ = [
    "PROFILE_VERSION",
    "Profile",
    "ProfileFormatError",
    "UnitProfile",
    "load_profile",
    *_LAZY,
]


def load_profile(path: str) -> Profile:
    return Profile.load(path)


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autopipe.profiler' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module_name), attr)
