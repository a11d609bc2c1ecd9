"""One stage on one micro-batch as an autograd node (autopipe.runtime.stage)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from autopipe.runtime.stage import StageFunction, phony

CPU = torch.device("cpu")


def test_phony_is_one_empty_leaf_per_device() -> None:
    leaf = phony(CPU)
    assert leaf is phony(torch.device("cpu"))
    assert leaf.numel() == 0 and leaf.requires_grad and leaf.is_leaf


def test_backward_runs_the_private_graph_and_returns_the_input_gradient() -> None:
    torch.manual_seed(0)
    weight = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    backwards: list[int] = []

    @contextmanager
    def on_backward() -> Iterator[None]:
        backwards.append(1)
        yield

    def run(h: torch.Tensor, n: int) -> tuple[object, ...]:
        assert h.is_leaf and h is not x  # the stage sees a detached leaf
        return h * weight, torch.arange(n), n

    scaled, index, n = StageFunction.apply(run, on_backward, phony(CPU), x, 3)
    assert n == 3 and torch.equal(index, torch.arange(3))
    assert scaled.requires_grad and not index.requires_grad
    (scaled * 2).sum().backward()
    assert backwards == [1]
    torch.testing.assert_close(x.grad, 2 * weight.detach())
    torch.testing.assert_close(weight.grad, 2 * x.detach())  # accumulated into .grad


def test_a_second_backward_is_refused_in_one_line() -> None:
    x = torch.ones(2, requires_grad=True)
    (y,) = StageFunction.apply(lambda h: (h * 3,), nullcontext, phony(CPU), x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through a pipeline output ran twice"):
        y.sum().backward()
