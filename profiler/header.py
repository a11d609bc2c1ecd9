"""The fields every Profile carries about how it was made, filled in one place for both
profilers (measured and analytic)."""

from __future__ import annotations

from typing import Any

import torch
from autopipe.profiler.cache import autopipe_version
from autopipe.profiler.units import UnitGraph

__all__ = ["profile_header"]


def profile_header(ug: UnitGraph, dtype: torch.dtype, model: str) -> dict[str, Any]:
    """``Profile`` keyword arguments describing the trace (tracer, granularity, unit
    patterns), the numbers (dtype name, bytes per parameter element) and the software
    (torch and autopipe versions) of a profile of ``model`` (its name)."""
    return {
        "model": model,
        "tracer": ug.tracer,
        "granularity": ug.granularity,
        "unit_patterns": list(ug.unit_patterns or []),
        "dtype": str(dtype).removeprefix("torch."),
        "bytes_per_parameter": torch.empty((), dtype=dtype, device="meta").element_size(),
        "torch_version": torch.__version__,
        "autopipe_version": autopipe_version(),
    }
