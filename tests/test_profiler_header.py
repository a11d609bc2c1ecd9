"""The fields every Profile carries about how it was made (autopipe.profiler.header)."""

from __future__ import annotations

import torch
from autopipe.profiler.cache import autopipe_version
from autopipe.profiler.header import profile_header
from autopipe.profiler.units import trace_units
from torch import nn


def test_header_of_a_traced_model_at_two_dtypes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    graph = trace_units(model, torch.randn(2, 4), units=["0", "2"])
    header = profile_header(graph, torch.bfloat16, "Tiny")
    assert header == {
        "model": "Tiny",
        "tracer": "fx",
        "granularity": graph.granularity,
        "unit_patterns": ["0", "2"],
        "dtype": "bfloat16",
        "bytes_per_parameter": 2,
        "torch_version": torch.__version__,
        "autopipe_version": autopipe_version(),
    }
    assert profile_header(graph, torch.float64, "Tiny")["bytes_per_parameter"] == 8
