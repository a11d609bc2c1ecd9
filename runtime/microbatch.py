"""Split a mini-batch into micro-batches along dim 0 and join the outputs back.

A mini-batch of ``N`` samples becomes ``min(microbatches, N)`` micro-batches whose sizes differ by
at most one (``torch.tensor_split``), so a batch not divisible by ``microbatches`` splits unevenly
and a batch smaller than ``microbatches`` gives fewer micro-batches. Cost: O(number of values);
slicing makes views, no copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.profiler.inputs import batch_size_of

__all__ = ["gather", "scatter"]


def scatter(values: Sequence[Any], microbatches: int) -> list[list[Any]]:
    """Split every tensor leaf of ``values`` whose dim 0 equals the batch size into micro-batches.

    ``values`` is a flat sequence of inputs (tensors, or nested lists/tuples/dicts of them).
    Tensor leaves of another leading size (a shared ``(T, T)`` mask) and non-tensors are
    passed unchanged to every micro-batch. Returns ``M = min(microbatches, N)`` lists shaped like
    ``values``; micro-batch ``i`` holds samples ``[start_i, end_i)`` of the mini-batch.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches}")
    batch = batch_size_of(values)
    num = max(1, min(microbatches, batch))
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


def gather(outputs: Sequence[Any], sizes: Sequence[float] | None = None) -> Any:
    """Join per-micro-batch outputs (same structure each) into the mini-batch's output.

    Tensor leaves with a batch dimension are concatenated along dim 0 (``torch.cat``;
    autograd flows back to every micro-batch). A 0-dim floating tensor (a loss the model
    computes itself, e.g. a Hugging Face ``output.loss``) has no batch dimension: it becomes
    the mean over micro-batches weighted by ``sizes``: the items each micro-batch's loss
    averages over (its samples, or its labelled tokens:
    :class:`autopipe.profiler.objective.LabelItems`; equal weights if not given), which is
    the mini-batch's loss when the loss is a mean over those items.
    Non-tensor leaves must be equal across micro-batches and are kept once.
    """
    if len(outputs) == 1:
        return outputs[0]
    weights = [1.0] * len(outputs) if sizes is None else [float(n) for n in sizes]
    if sum(weights) == 0:  # nothing counted anywhere: the plain model's loss is NaN too
        weights = [1.0] * len(outputs)
    total = sum(weights)
    flat = [pytree.tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    for _, other in flat[1:]:
        if other != spec:
            raise TypeError("micro-batches returned outputs of different structure; cannot gather")
    joined: list[Any] = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        head = column[0]
        if isinstance(head, torch.Tensor):
            if head.dim() > 0:
                joined.append(torch.cat(column, dim=0))
            elif head.is_floating_point():
                # A micro-batch that counts nothing (all labels ignored) has a NaN mean.
                terms = [t * (w / total) for t, w in zip(column, weights, strict=True) if w]
                joined.append(torch.stack(terms).sum())
            else:
                raise TypeError(
                    f"the model returns a 0-dim {head.dtype} tensor, which has no batch "
                    "dimension to join over micro-batches; return it per sample"
                )
        else:
            joined.append(head)
    return pytree.tree_unflatten(joined, spec)
