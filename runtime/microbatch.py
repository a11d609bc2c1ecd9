"""Split a mini-batch into micro-batches along dim 0 and join the outputs back.

A mini-batch of ``N`` samples becomes ``min(chunks, N)`` micro-batches whose sizes differ by
at most one (``torch.tensor_split``), so a batch not divisible by ``chunks`` splits unevenly
and a batch smaller than ``chunks`` gives fewer micro-batches. Cost: O(number of values);
slicing makes views, no copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["batch_size_of", "gather", "scatter"]


def batch_size_of(values: Sequence[Any]) -> int:
    """Size of dim 0 of the first tensor with at least one dimension in ``values``."""
    for value in pytree.tree_leaves(list(values)):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise TypeError("the pipeline needs at least one input tensor with a batch dimension (dim 0)")


def scatter(values: Sequence[Any], chunks: int) -> list[list[Any]]:
    """Split every tensor leaf of ``values`` whose dim 0 equals the batch size into micro-batches.

    ``values`` is a flat sequence of inputs (tensors, or nested lists/tuples/dicts of them).
    Tensor leaves of another leading size (a shared ``(T, T)`` mask) and non-tensors are
    passed unchanged to every micro-batch. Returns ``M = min(chunks, N)`` lists shaped like
    ``values``; micro-batch ``i`` holds samples ``[start_i, end_i)`` of the mini-batch.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks}")
    batch = batch_size_of(values)
    num = max(1, min(chunks, batch))
    leaves, spec = pytree.tree_flatten(list(values))
    pieces: list[list[Any]] = [[] for _ in range(num)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            parts = torch.tensor_split(leaf, num, dim=0)
        else:
            parts = (leaf,) * num
        for piece, part in zip(pieces, parts, strict=True):
            piece.append(part)
    return [pytree.tree_unflatten(piece, spec) for piece in pieces]


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenate per-micro-batch outputs (same structure each) along dim 0.

    Tensor leaves are concatenated with ``torch.cat`` (autograd flows back to every
    micro-batch); non-tensor leaves must be equal across micro-batches and are kept once.
    A 0-dim tensor has no batch dimension to join, so it is refused.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise TypeError("micro-batches returned outputs of different structure; cannot gather")
    joined: list[Any] = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        head = column[0]
        if isinstance(head, torch.Tensor):
            if head.dim() == 0:
                raise TypeError(
                    "pipeline output is a 0-dim tensor (e.g. a loss); return per-sample outputs "
                    "with a batch dimension and reduce them after the pipeline"
                )
            joined.append(torch.cat(column, dim=0))
        else:
            joined.append(head)
    return pytree.tree_unflatten(joined, spec)
