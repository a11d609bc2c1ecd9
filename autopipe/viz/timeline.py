"""The plots' timeline names, kept for older imports: the one Timeline lives in the planner.

``Task``, ``Timeline``, ``PHASES`` and the Chrome trace reader and writer are
:mod:`autopipe.planner.timeline`'s; ``timeline_from_chrome_trace`` is its
``load_chrome_trace`` and ``timeline_to_chrome_trace`` its ``to_chrome_trace``. Torch-free.
"""

from __future__ import annotations

from autopipe.planner.timeline import (
    PHASES,
    Task,
    Timeline,
    TimelineFormatError,
    load_chrome_trace,
    normalize_phase,
    to_chrome_trace,
)

__all__ = [
    "PHASES",
    "Task",
    "Timeline",
    "TimelineFormatError",
    "normalize_phase",
    "timeline_from_chrome_trace",
    "timeline_to_chrome_trace",
]

timeline_from_chrome_trace = load_chrome_trace
timeline_to_chrome_trace = to_chrome_trace
