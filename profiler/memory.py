"""Memory accounting: tensor sizes, saved-for-backward bytes, parameters per unit.

Saved activations are counted with ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd packs for backward passes through the hook; it is counted once per
storage (views such as the q/k/v splits of one projection share one storage) and
parameters/buffers are left out (they are counted as parameter bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from autopipe.profiler.units import UnitGraph
from torch import fx, nn

from autopipe.core.optimizer import optimizer_state_bytes


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (what a send of it would move)."""
    return t.numel() * t.element_size()


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the memory a tensor lives in: device and storage base address."""
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return str(t.device), id(t)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``t`` (a view keeps all of it alive)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def _storage_of(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return t


@dataclass
class SavedTensorCounter:
    """Counts bytes saved for backward, attributed to a current tag (a unit index).

    Each storage counts once, for the first tag that saves it: a tensor saved both by the
    ReLU that made it and by the Linear that reads it is one allocation. Storages listed in
    ``exclude`` (parameters, buffers) are not activations and are skipped.
    """

    exclude: set[tuple[str, int]] = field(default_factory=set)
    bytes_by_tag: dict[Any, int] = field(default_factory=dict)
    tag: Any = None
    _seen: set[tuple[str, int]] = field(default_factory=set)
    _alive: list[Any] = field(default_factory=list)
    """The storages counted, kept alive while counting: a freed one's address could be
    reused by a later tensor, which would then pass for already counted."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tag.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.exclude and key not in self._seen:
            self._seen.add(key)
            self._alive.append(_storage_of(t))
            self.bytes_by_tag[self.tag] = self.bytes_by_tag.get(self.tag, 0) + storage_bytes(t)
        # Not ``t`` itself: a saved output would then hold its own grad_fn, a reference
        # cycle that keeps the whole forward graph (and its weights) alive after use.
        return t.detach()

    @contextmanager
    def counting(self) -> Iterator[SavedTensorCounter]:
        """Install the hooks; the packed tensors are kept as detached aliases (no copies)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            self._alive.clear()


def parameter_storages(model: nn.Module) -> set[tuple[str, int]]:
    """Storage keys of every parameter and buffer of ``model``."""
    keys = {storage_key(p) for p in model.parameters()}
    keys |= {storage_key(b) for b in model.buffers()}
    return keys


def canonical_parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> first qualified name`` (tied parameters map to one name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _resolve(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def unit_tensors(
    ug: UnitGraph, model: nn.Module
) -> list[tuple[list[nn.Parameter], list[torch.Tensor]]]:
    """For each unit, ``(parameters, buffers)`` it uses, each listed once per unit.

    Parameters come from the unit's ``call_module`` targets and from ``get_attr`` nodes
    used by the unit's nodes (export graphs). A tied parameter appears in every unit that
    uses it. Targets are resolved on ``model``. O(nodes + parameters).
    """
    per_unit: list[dict[int, torch.Tensor]] = [{} for _ in range(ug.num_units)]
    graph: fx.Graph = ug.graph_module.graph
    for node in graph.nodes:
        if node.op == "call_module":
            sub = model.get_submodule(str(node.target))
            unit = ug.node_unit[node.name]
            for t in [*sub.parameters(), *sub.buffers()]:
                per_unit[unit].setdefault(id(t), t)
        elif node.op == "get_attr":
            try:
                value = _resolve(model, str(node.target))
            except AttributeError:
                value = getattr(ug.graph_module, str(node.target), None)
            if not isinstance(value, torch.Tensor):
                continue
            units = {ug.node_unit[u.name] for u in node.users if u.op != "output"}
            for unit in units:
                per_unit[unit].setdefault(id(value), value)
    out = []
    for tensors in per_unit:
        params = [t for t in tensors.values() if isinstance(t, nn.Parameter)]
        buffers = [t for t in tensors.values() if not isinstance(t, nn.Parameter)]
        out.append((params, buffers))
    return out


def _optimizer_bytes(
    optimizer: str,
    state_bytes_per_parameter: float | None,
    trainable: list[nn.Parameter],
    trainable_bytes: int,
) -> int:
    count = sum(p.numel() for p in trainable)
    if state_bytes_per_parameter is None:
        return optimizer_state_bytes(optimizer, count, trainable_bytes)
    return max(int(round(state_bytes_per_parameter * count)) - 2 * trainable_bytes, 0)


def parameter_accounting(
    ug: UnitGraph,
    model: nn.Module,
    optimizer: str,
    state_bytes_per_parameter: float | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """Per-unit parameter figures and the whole-model parameter bytes (tied counted once).

    A tied parameter counts in every unit that uses it and is named in each such unit's
    ``shared_parameters``. ``state_bytes_per_parameter`` (parameter + gradient + optimizer
    state, e.g. 16) overrides ``optimizer``: the optimizer bytes are what is left after the
    parameter and its gradient. O(parameters + graph nodes).
    """
    per_unit = unit_tensors(ug, model)
    names = canonical_parameter_names(model)
    users: dict[int, int] = {}
    for params, _ in per_unit:
        for p in params:
            users[id(p)] = users.get(id(p), 0) + 1
    rows = []
    for params, buffers in per_unit:
        trainable = [p for p in params if p.requires_grad]
        trainable_bytes = sum(tensor_bytes(p) for p in trainable)
        rows.append(
            {
                "parameter_count": sum(p.numel() for p in params),
                "parameter_bytes": sum(tensor_bytes(p) for p in params),
                "gradient_bytes": trainable_bytes,
                "optimizer_bytes": _optimizer_bytes(
                    optimizer, state_bytes_per_parameter, trainable, trainable_bytes
                ),
                "buffer_bytes": sum(tensor_bytes(b) for b in buffers),
                "shared_parameters": sorted(
                    names.get(id(p), "") for p in params if users[id(p)] > 1
                ),
            }
        )
    unique = {id(p): p for p in model.parameters()}
    return rows, sum(tensor_bytes(p) for p in unique.values())
