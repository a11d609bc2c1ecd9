"""Flatten model inputs/outputs (tensors, tuples, lists, dicts, dataclasses) to tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree


def leaves(value: Any) -> list[Any]:
    """All leaves of ``value`` in order: torch pytree flattening, then the fields of any
    dataclass instance that is not a registered pytree node (e.g. a model's output class)."""
    out: list[Any] = []
    for leaf in pytree.tree_leaves(value):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
        else:
            out.append(leaf)
    return out


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors among :func:`leaves`."""
    return [x for x in leaves(value) if isinstance(x, torch.Tensor)]


def float_tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The floating-point (or complex) tensors among :func:`leaves`: those that carry gradients."""
    return [x for x in tensor_leaves(value) if x.is_floating_point() or x.is_complex()]


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Apply ``fn`` to every tensor in ``value``, keeping its structure (pytree containers and
    dataclass instances, rebuilt with ``dataclasses.replace``)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {
                f.name: map_tensors(fn, getattr(x, f.name)) for f in dataclasses.fields(x) if f.init
            }
            return dataclasses.replace(x, **changes)
        return x

    return pytree.tree_map(leaf, value)
