"""The tracer chain's own rules (autopipe.profiler.trace): inference features switched off,
defaults left out of the trace, random masks refused, the hooks fallback's checks. (The
chain itself, fx -> export -> hooks, is exercised in tests/test_profiler_units.py.)"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import pytest
import torch
from autopipe.profiler.trace import (
    TraceError,
    batch_is_dynamic,
    trace_model,
    trace_sequential_hooks,
    training_config,
)
from torch import nn


class Cached(nn.Module):
    def __init__(self, generates: bool | None) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=True)
        self.inner = nn.Linear(2, 2)
        self.inner.config = self.config  # a nested module sharing the config
        if generates is not None:
            self.can_generate = lambda: generates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_the_cache_flag_is_switched_off_once_per_config() -> None:
    model = Cached(generates=None)
    assert training_config(model) == ["Cached.config.use_cache"]
    assert model.config.use_cache is False and training_config(model) == []


def test_switching_off_a_generators_cache_is_said_an_encoders_is_not() -> None:
    with pytest.warns(UserWarning, match=r"set Cached.config.use_cache = False for training"):
        trace_model(Cached(generates=True), torch.randn(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm, tracer = trace_model(Cached(generates=False), torch.randn(1, 2))
    assert tracer == "fx" and batch_is_dynamic(gm)


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(x)
        if mask is not None:  # a proxy would take this branch
            h = h * mask
        return h


def test_unprovided_defaults_are_traced_as_given() -> None:
    model, x = OptionalMask(), torch.randn(2, 3)
    gm, tracer = trace_model(model, x)
    assert tracer == "fx"
    assert "mul" not in {n.name for n in gm.graph.nodes}
    torch.testing.assert_close(gm(x), model(x))


class SpecAugmented(nn.Module):
    def __init__(self, mask_time_prob: float) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(
            apply_spec_augment=True, mask_time_prob=mask_time_prob, mask_feature_prob=0.0
        )
        self.lin = nn.Linear(4, 4)

    def forward(
        self, input_values: torch.Tensor, mask_time_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.lin(input_values)


def test_a_mask_drawn_inside_forward_is_refused_naming_the_way_out() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(TraceError) as caught:
        trace_model(SpecAugmented(0.05), x)
    line = str(caught.value)
    assert line.startswith("SpecAugmented draws SpecAugment's mask inside forward with numpy")
    assert "(config.mask_time_prob = 0.05)" in line and "pass mask_time_indices" in line
    mask = torch.zeros(2, 4, dtype=torch.bool)
    trace_model(SpecAugmented(0.05), {"input_values": x, "mask_time_indices": mask})
    trace_model(SpecAugmented(0.0), x)  # nothing drawn: nothing to refuse


def test_a_forced_tracer_is_checked_and_does_not_fall_back() -> None:
    model, x = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(3, 2)
    with pytest.raises(ValueError, match="tracer 'jit' is not one of fx, export, hooks"):
        trace_model(model, x, tracer="jit")
    gm, tracer = trace_model(model, x, tracer="hooks")
    assert tracer == "hooks"
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1"]
    torch.testing.assert_close(gm(x), model(x))


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.a(x))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + x)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (Twice(), "forward calls a child more than once"),
        (Residual(), "child 'b' does not take exactly the previous child's output"),
    ],
)
def test_the_hooks_fallback_takes_only_a_plain_chain(model: nn.Module, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        trace_sequential_hooks(model, (torch.randn(1, 2),), {})
    with pytest.raises(TraceError, match="positional inputs only"):
        trace_sequential_hooks(model, (), {"x": torch.randn(1, 2)})


class RowsBranch(nn.Module):
    """ReLU or not by a test on the batch size (``rows``): export keeps the branch taken."""

    def __init__(self, takes: Callable[[int], bool]) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.takes = takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return torch.relu(h) if self.takes(h.shape[0]) else h


@pytest.mark.parametrize(
    ("takes", "dynamic"),
    [
        (lambda rows: rows == 8, False),  # the symbol is replaced by 8
        (lambda rows: rows > 4, False),  # range_constraints narrowed to [5, oo)
        (lambda rows: rows != 2, False),  # a guard on the symbol
        (lambda rows: rows % 4 == 0, False),
        (lambda rows: rows > 0, True),  # always true: nothing to guard
    ],
)
def test_an_export_graph_that_branches_on_the_batch_size_is_not_batch_dynamic(
    takes: Callable[[int], bool], dynamic: bool
) -> None:
    gm, tracer = trace_model(RowsBranch(takes), torch.randn(8, 2), tracer="export")
    assert tracer == "export" and batch_is_dynamic(gm) is dynamic


def test_an_export_graph_is_batch_dynamic_from_exports_smallest_symbolic_size() -> None:
    # Export takes sizes 0 and 1 for constants: ``rows > 1`` is true without a guard.
    gm, _ = trace_model(RowsBranch(lambda rows: rows > 1), torch.randn(8, 2), tracer="export")
    assert batch_is_dynamic(gm) and batch_is_dynamic(gm, 2) and not batch_is_dynamic(gm, 1)
    fx_gm, _ = trace_model(nn.Linear(2, 2), torch.randn(8, 2), tracer="fx")
    assert batch_is_dynamic(fx_gm, 1)


class Labelled(nn.Module):
    """Two batch inputs whose rows must match: export guards ``Eq(2*s0, 2*s1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return (self.a(x).flatten() - labels.flatten()).square().mean()


def test_a_guard_that_only_equates_the_batch_inputs_sizes_keeps_the_batch_dynamic() -> None:
    gm, tracer = trace_model(Labelled(), (torch.randn(8, 2), torch.randn(8, 2)), tracer="export")
    assert tracer == "export" and batch_is_dynamic(gm, 2)
