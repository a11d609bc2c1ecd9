"""autopipe.profiler: model -> Profile (per-unit time and memory).

Imports torch only when a profiling function is used, so the torch-free
``autopipe.profiler.profile`` data module stays importable by the planner.
"""

from __future__ import annotations

from autopipe.profiler.profile import PROFILE_VERSION, Profile, ProfileFormatError, UnitProfile

from autopipe.lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
