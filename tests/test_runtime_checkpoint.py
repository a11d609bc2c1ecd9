"""Re-materialization of a stage (autopipe.runtime.checkpoint): recomputed once in backward,
with the forward's random state and without moving BatchNorm statistics twice."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from autopipe.runtime.checkpoint import checkpointed, is_recomputing, recomputing
from torch import nn


def test_recomputed_once_in_backward_with_the_same_dropout_mask() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    x = torch.randn(5, 6, requires_grad=True)
    seen: list[bool] = []
    recomputes: list[int] = []

    def stage(h: torch.Tensor) -> torch.Tensor:
        seen.append(is_recomputing())
        return nn.functional.dropout(torch.tanh(lin(h)), p=0.5, training=True)

    @contextmanager
    def on_recompute() -> Iterator[None]:
        recomputes.append(1)
        yield

    torch.manual_seed(7)
    out = checkpointed(stage, [x], [lin], on_recompute=on_recompute)
    assert seen == [False] and not is_recomputing()
    out.square().sum().backward()
    assert seen == [False, True] and len(recomputes) == 1
    got = (x.grad.clone(), lin.weight.grad.clone())

    # The same forward kept in memory: equal gradients need the same mask in the recompute.
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    torch.manual_seed(7)
    expected = stage(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    expected.square().sum().backward()
    torch.testing.assert_close(got[0], x.grad, rtol=0, atol=0)
    torch.testing.assert_close(got[1], lin.weight.grad, rtol=0, atol=0)


def test_batch_norm_statistics_move_once() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    out = checkpointed(bn, [x], [bn])
    after_forward = (bn.running_mean.clone(), bn.running_var.clone())
    assert int(bn.num_batches_tracked) == 1
    out.sum().backward()
    assert int(bn.num_batches_tracked) == 1
    assert torch.equal(bn.running_mean, after_forward[0])
    assert torch.equal(bn.running_var, after_forward[1])
    torch.testing.assert_close(bn.running_mean, 0.1 * x.detach().mean(0))


def test_recomputing_nests_and_unwinds_on_error() -> None:
    assert not is_recomputing()
    with recomputing():
        with recomputing():
            assert is_recomputing()
        assert is_recomputing()
    try:
        with recomputing():
            raise KeyError("boom")
    except KeyError:
        pass
    assert not is_recomputing()
