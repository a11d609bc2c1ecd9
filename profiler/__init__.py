"""autopipe.profiler: model -> Profile (per-unit time and memory).

Imports torch only when a profiling function is used, so the torch-free
``autopipe.core.profile`` data module stays importable by the planner.
"""

from __future__ import annotations

from autopipe.core.lazy import lazy_attributes
from autopipe.core.profile import PROFILE_VERSION, Profile, ProfileFormatError, UnitProfile

_LAZY = {
    "profile": ("autopipe.profiler.measure", "profile"),
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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
