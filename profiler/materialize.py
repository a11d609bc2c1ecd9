"""Measuring a model larger than the device: one unit's weights at a time.

The model is built on the meta device (no memory). For each unit that must run, the
parameters and buffers it uses are *materialized* on the profiling device (allocated in
place with ``torch.utils.swap_tensors``, so every module, graph and partition that refers
to them sees the real tensors), initialised (the owning modules' ``reset_parameters``,
else a plain fill), the unit is captured and timed, and its tensors go back to meta. Peak
memory is one unit's weights and gradients plus the activations the pipeline keeps, not
the model.

Shapes and bytes of every graph value (output and cut bytes) come from one run of the
graph on meta tensors, where nothing is allocated either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from autopipe.profiler.memory import storage_key
from autopipe.profiler.opcount import WeightMatmulCounter
from autopipe.profiler.tree import map_tensors, tensor_leaves
from autopipe.profiler.units import UnitGraph
from torch import fx, nn
from torch.utils import swap_tensors

META = torch.device("meta")

# 1-D parameters with these names scale (norm weights): ones keep activations in range.
_SCALE_NAMES = ("weight", "scale", "gamma", "g")


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def to_meta(example_inputs: Any) -> Any:
    """The inputs as meta tensors (same shapes and dtypes, no data)."""
    return map_tensors(lambda t: t.to(META), example_inputs)


def _resolve(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def unit_state(ug: UnitGraph, model: nn.Module) -> list[list[torch.Tensor]]:
    """Per unit, every parameter, buffer and graph constant it reads, each once per unit.

    From the unit's ``call_module`` targets (their parameters and buffers) and ``get_attr``
    nodes, resolved on ``model`` (pass the traced graph module to get the very tensors the
    split partitions run with), else on the traced graph module. A tensor used by two units
    (a tied weight) is listed in both. O(nodes + parameters).
    """
    per_unit: list[dict[int, torch.Tensor]] = [{} for _ in range(ug.num_units)]
    for node in ug.graph_module.graph.nodes:
        if node.op == "call_module":
            sub = model.get_submodule(str(node.target))
            for t in [*sub.parameters(), *sub.buffers()]:
                per_unit[ug.node_unit[node.name]].setdefault(id(t), t)
        elif node.op == "get_attr":
            try:
                value = _resolve(model, str(node.target))
            except AttributeError:
                value = getattr(ug.graph_module, str(node.target), None)
            if not isinstance(value, torch.Tensor):
                continue
            for user in node.users:
                if user.op != "output":
                    per_unit[ug.node_unit[user.name]].setdefault(id(value), value)
    return [list(d.values()) for d in per_unit]


def own_meta_state(gm: fx.GraphModule) -> int:
    """Give a graph module traced on meta fresh meta tensors of its own (same shapes, dtypes,
    parameter-ness and sharing: one replacement per original tensor, so tied weights stay
    tied). Tracers (``torch.export``'s fake-tensor memo) keep weak references to the tensors
    they saw, and ``swap_tensors`` refuses tensors that have any. Returns how many tensors
    were replaced. O(parameters + nodes)."""
    fresh: dict[int, torch.Tensor] = {}

    def new(t: torch.Tensor) -> torch.Tensor:
        found = fresh.get(id(t))
        if found is None:
            data = torch.empty(t.shape, dtype=t.dtype, device=META)
            found = fresh[id(t)] = _like(t, data)
        return found

    for module in gm.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = new(p)  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = new(b)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, attr = str(node.target).rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
            value = getattr(owner, attr)
        except AttributeError:
            continue
        if (
            isinstance(value, torch.Tensor)
            and attr not in owner._parameters
            and attr not in (owner._buffers)
        ):
            object.__setattr__(owner, attr, new(value))
    return len(fresh)


class Materializer:
    """Allocates and frees the tensors of one unit at a time on ``device``.

    ``exclude``: the storage keys the saved-tensor counter treats as parameters; kept in step
    with what is allocated, so weights saved for backward never count as activations.
    Initialisation: a plain fill (normal(0, 0.02) for matrices, ones for 1-D scales, zeros
    otherwise), then ``reset_parameters()`` / ``_reset_parameters()`` of every module that owns
    one of the tensors, so the values are the model's usual ones where it defines them (the
    values do not change the cost of dense kernels; the fill only avoids NaN and denormal
    slow paths). Cost per call: O(bytes materialized) to fill.
    """

    def __init__(self, model: nn.Module, device: torch.device, exclude: set[Any]) -> None:
        self.device = device
        self.exclude = exclude
        self.live: dict[int, torch.Tensor] = {}
        self.peak_bytes = 0
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for name, t in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]:
                if t is not None:
                    self._owners.setdefault(id(t), []).append((module, name))

    @property
    def live_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.live.values())

    def materialize(self, tensors: Iterable[torch.Tensor]) -> None:
        """Give every meta tensor in ``tensors`` real, initialised storage on the device."""
        fresh = [t for t in tensors if t.is_meta and id(t) not in self.live]
        if not fresh:
            return
        for t in fresh:
            real = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            swap_tensors(t, _like(t, real))
            self.live[id(t)] = t
            self.exclude.add(storage_key(t))
        with torch.no_grad():
            for t in fresh:
                _fill(t, self._owners.get(id(t), [(None, "")])[0][1])
            resetting = {
                id(m): m for t in fresh for m, _ in self._owners.get(id(t), []) if m is not None
            }
            for module in resetting.values():
                for reset in ("reset_parameters", "_reset_parameters"):
                    fn = getattr(module, reset, None)
                    if callable(fn):
                        fn()
                        break
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, tensors: Iterable[torch.Tensor] | None = None) -> None:
        """Send ``tensors`` (default: everything materialized) back to meta, gradients too."""
        chosen = list(self.live.values()) if tensors is None else list(tensors)
        for t in chosen:
            if id(t) not in self.live:
                continue
            self.exclude.discard(storage_key(t))
            t.grad = None
            swap_tensors(t, _like(t, torch.empty(t.shape, dtype=t.dtype, device=META)))
            del self.live[id(t)]


def _like(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``data`` wrapped as the same kind of tensor as ``template`` (Parameter or plain)."""
    if isinstance(template, nn.Parameter):
        return nn.Parameter(data, requires_grad=template.requires_grad)
    return data.requires_grad_(template.requires_grad) if data.is_floating_point() else data


def _fill(t: torch.Tensor, name: str) -> None:
    if not t.is_floating_point():
        t.zero_()
    elif t.dim() >= 2:
        t.normal_(0.0, 0.02)
    elif name.rsplit(".", 1)[-1] in _SCALE_NAMES:
        t.fill_(1.0)
    else:
        t.zero_()


def retarget_devices(graph_modules: Iterable[fx.GraphModule], device: torch.device) -> int:
    """Replace ``device=meta`` constants that tracing on meta baked into graphs (e.g. the
    ``device`` of an ``arange`` in an exported graph) by ``device``. Returns how many
    arguments changed. O(nodes)."""
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed += 1
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    for gm in graph_modules:
        before = changed
        for node in gm.graph.nodes:
            node.args = swap(node.args)
            node.kwargs = swap(node.kwargs)
        if changed != before:
            gm.recompile()
    return changed


def meta_storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a meta tensor's storage (all meta storages have address 0)."""
    return "meta", t.untyped_storage()._cdata


def meta_node_bytes(
    ug: UnitGraph, meta_flat_inputs: Sequence[Any], flops: WeightMatmulCounter | None = None
) -> dict[str, list[tuple[tuple[str, int], int, int]]]:
    """Per graph node, ``(storage key, offset, bytes)`` of each tensor in its value, from one
    no-grad run of the traced graph on meta tensors (the model's parameters must be on meta).
    Values are kept alive to the end so no storage identity is reused. ``flops``: the same run
    also counts each unit's weight matmuls into it. O(nodes)."""
    info: dict[str, list[tuple[tuple[str, int], int, int]]] = {}
    keep: list[Any] = []

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if flops is not None:
                flops.at(ug.node_unit, n)
            out = super().run_node(n)
            leaves = tensor_leaves(out)
            keep.append(leaves)
            info[n.name] = [
                (meta_storage_key(t), int(t.storage_offset()), t.numel() * t.element_size())
                for t in leaves
            ]
            return out

    with torch.no_grad(), flops if flops is not None else nullcontext():
        Recorder(ug.graph_module).run(*meta_flat_inputs, enable_io_processing=False)
    return info
