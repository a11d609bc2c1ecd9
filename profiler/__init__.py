"""autopipe.profiler: model -> Profile (per-unit time and memory).

Imports torch only when a profiling function is used, so the torch-free
``autopipe.profiler.profile_data`` data module stays importable by the planner.
"""

from __future__ import annotations

import sys

from autopipe.profiler import profile_data as _profile_data
from autopipe.profiler.profile_data import PROFILE_VERSION, Profile, ProfileFormatError, UnitProfile

from autopipe.lazy import lazy_attributes

# The data module was ``profile.py``, which collided with the measuring function's name:
# ``import autopipe.profiler.profile`` still finds the data module, while the package's
# ``profile`` attribute is the function (``autopipe.profiler.measure.profile``).
sys.modules.setdefault(f"{__name__}.profile", _profile_data)

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
