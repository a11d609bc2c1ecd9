"""Micro-batching (``autopipe.runtime.microbatch``): scatter along dim 0, gather with ``torch.cat``."""

from __future__ import annotations

import pytest
import torch
from autopipe.runtime.microbatch import gather, scatter


def test_scatter_uneven_small_and_broadcast() -> None:
    x, mask = torch.arange(10).view(10, 1), torch.ones(3, 3)
    pieces = scatter([x, mask, 7], 4)
    assert [p[0].shape[0] for p in pieces] == [3, 3, 2, 2]
    assert all(p[1] is mask and p[2] == 7 for p in pieces)  # other sizes / non-tensors broadcast
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    assert len(scatter([torch.zeros(2, 5)], 7)) == 2  # fewer samples than chunks
    with pytest.raises(ValueError):
        scatter([x], 0)
    with pytest.raises(TypeError):
        scatter([3], 2)


def test_gather_nested_outputs() -> None:
    outs = [{"y": torch.full((2, 1), float(i)), "n": 5} for i in range(3)]
    joined = gather(outs)
    assert joined["n"] == 5 and joined["y"].flatten().tolist() == [0, 0, 1, 1, 2, 2]
    # A 0-dim loss per micro-batch: the mean weighted by the micro-batch sizes.
    loss = gather([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
    assert float(loss) == pytest.approx(1.75)
    with pytest.raises(TypeError, match="0-dim torch.int64"):
        gather([torch.tensor(1), torch.tensor(2)])
