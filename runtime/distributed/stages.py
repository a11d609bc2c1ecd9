"""One stage of a plan as a module for ``torch.distributed.pipelining``.

The stage graphs come from :func:`autopipe.runtime.planned_stages.partition` (the route the
single-process runtime takes too): ``PipelineStage`` receives every input of stage ``k`` from
stage ``k - 1``, so values that skip a stage are relayed through it. Here:
:class:`StageModule`, one stage as a module with optional re-materialization, that also
carries Python numbers across a cut (a symbolic batch size, a sequence length) as 0-dim
tensors, since only tensors travel between ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.profiler.units import UnitGraph
from autopipe.runtime.checkpoint import checkpointed
from autopipe.runtime.split import StageGraph, StageSplitError, split_graph, split_units
from torch import fx, nn

__all__ = ["StageModule", "split_stages"]

_NUMBERS = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool)


def split_stages(unit_graph: UnitGraph, unit_stage: Sequence[int]) -> list[StageGraph]:
    """Every stage graph for a unit -> stage map (see :func:`autopipe.runtime.split.split_graph`).

    ``unit_stage[u]`` is the stage of unit ``u``; it must be non-decreasing, start at 0 and
    have no gaps.
    """
    if list(unit_stage) != sorted(unit_stage) or unit_stage[0] != 0:
        raise StageSplitError("stages must be contiguous runs of units starting at stage 0")
    num_stages = max(unit_stage) + 1
    if sorted(set(unit_stage)) != list(range(num_stages)):
        raise StageSplitError("every stage needs at least one unit")
    node_stage = {name: unit_stage[u] for name, u in unit_graph.node_unit.items()}
    return split_graph(unit_graph.graph_module, node_stage, num_stages)


@dataclass
class Wire:
    """How one value crossing a cut travels: its pytree leaves, in order, each a tensor or a
    number sent as a 0-dim tensor (``numbers[i]``), rebuilt with ``spec``."""

    spec: pytree.TreeSpec
    numbers: list[bool]

    @property
    def width(self) -> int:
        return len(self.numbers)


def wire_of(value: Any) -> Wire:
    """The wire format of an example of a value (a tensor, a number, or tuples/lists/dicts
    of them); ``TypeError`` naming the leaf torch.distributed.pipelining cannot send."""
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *_NUMBERS)):
            raise TypeError(f"a Python {type(leaf).__name__}")
    return Wire(spec, [isinstance(leaf, _NUMBERS) for leaf in leaves])


def _meta_wires(graph: fx.GraphModule) -> list[Wire]:
    """Wire formats read off the placeholders' traced values (export graphs record them;
    otherwise each input is taken to be one tensor)."""
    wires = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            try:
                wires.append(wire_of(val) if val is not None else wire_of(torch.empty(0)))
            except TypeError:
                wires.append(wire_of(torch.empty(0)))
    return wires


def to_wire(value: Any) -> list[torch.Tensor]:
    """The tensors that carry ``value`` between ranks (contiguous; numbers as 0-dim)."""
    leaves = pytree.tree_leaves(value)
    return [
        torch.tensor(v) if isinstance(v, _NUMBERS) else v.contiguous()
        for v in leaves  # wire_of checked the kinds
    ]


def from_wire(tensors: Sequence[Any], wires: Sequence[Wire]) -> list[Any]:
    """The values ``to_wire`` sent, rebuilt with their wire formats."""
    values, at = [], 0
    for wire in wires:
        leaves = list(tensors[at : at + wire.width])
        at += wire.width
        leaves = [
            t.item() if number and isinstance(t, torch.Tensor) else t
            for t, number in zip(leaves, wire.numbers, strict=True)
        ]
        values.append(pytree.tree_unflatten(leaves, wire.spec))
    return values


def _plain(t: torch.Tensor) -> torch.Tensor:
    """What crosses a cut: a plain tensor. A DTensor (a sequence-parallel norm's gathered
    output, a replicated activation of tensor parallelism) is sent as this rank's local
    tensor, differentiably (its gradient comes back as one of the same placement), so the
    next stage, which receives plain tensors, runs its backward the same way; a partial
    sum is refused (no rank holds the value)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if any(p.is_partial() for p in t.placements):
        raise TypeError(
            f"a value crossing a cut is a partial sum over the mesh ({t.placements}); "
            "plan a cut after the module that reduces it"
        )
    return t.to_local()


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _contiguous_gradient(t: Any) -> None:
    """Make the gradient of received input ``t`` contiguous, once per tensor (torch reuses
    a stage's receive buffers from step to step): it is sent back upstream, and gloo and
    NCCL send only contiguous tensors, while e.g. a ``sum`` right after a cut gives an
    expanded gradient. A no-op for gradients that already are contiguous."""
    if (
        isinstance(t, torch.Tensor)
        and t.requires_grad
        and t.is_leaf
        and not getattr(t, "_autopipe_contiguous_grad", False)
    ):
        t.register_hook(_contiguous)
        t._autopipe_contiguous_grad = True  # type: ignore[attr-defined]


class StageModule(nn.Module):
    """One stage's graph, optionally re-materialized (activation checkpointing).

    With ``checkpoint=True`` the forward runs under ``torch.utils.checkpoint`` (non-reentrant,
    RNG state preserved, via :func:`autopipe.runtime.checkpoint.checkpointed`): only the
    stage's inputs are kept for backward and the stage's forward is recomputed during its
    backward, GPipe's re-materialization; BatchNorm statistics do not move in the recompute.
    With ``node_unit`` too (the traced graph's nodes -> units) it is re-materialized per
    unit: each unit's graph runs under its own checkpoint, keeping that unit's inputs, so
    the backward re-computes one unit at a time.
    Parameter names are the original model's, behind the ``body.`` prefix (see
    :meth:`model_named_parameters`). The last stage returns the tensors of the model's
    output, flat, as torch wants; ``unflatten`` restores the model's own structure from the
    graph's output, and :meth:`model_output` does so for the loss (e.g. a ModelOutput).

    ``own_outputs``: a tensor sent on gets its own copy when it is a view, or when an
    operation inside the stage also uses it (and may have saved it for backward). The
    zero-bubble schedules need it: their input-gradient pass detaches a stage's outputs in
    place, which autograd refuses for views, and the weight pass then fails on a saved tensor
    detached that way. Costs one copy of each such output per micro-batch.
    """

    def __init__(
        self,
        stage: StageGraph,
        checkpoint: bool = False,
        unflatten: Callable[[Any], Any] | None = None,
        own_outputs: bool = False,
        node_unit: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.body = stage.module
        self._stage = stage
        self._node_unit = dict(node_unit) if node_unit is not None else None
        self._units: list[Callable[..., Any]] | None = None
        self.index = stage.index
        self.input_names = stage.input_names
        self.output_names = stage.output_names
        self.checkpoint = checkpoint
        self.own_outputs = own_outputs
        nodes = {n.name: n for n in stage.module.graph.nodes}
        self._used_inside = {
            name
            for name in stage.output_names
            if name in nodes and any(u.op != "output" for u in nodes[name].users)
        }
        self._unflatten = unflatten
        self._wires_in = _meta_wires(stage.module) if stage.index > 0 else []
        self.compiled = False
        """The stage runs ``torch.compile``'d (:meth:`compile_body`)."""

    def set_wires(self, inputs: Sequence[Wire]) -> None:
        """The wire formats of this stage's inputs (from example values of one micro-batch);
        without them each input is one tensor, or a number where the trace says so."""
        if self.index > 0:
            self._wires_in = list(inputs)

    def forward(self, *args: Any) -> Any:
        if self.index > 0 and torch.is_grad_enabled():
            for t in args:
                _contiguous_gradient(t)
        if self._wires_in:
            wanted = sum(w.width for w in self._wires_in)
            if len(args) != wanted:
                raise TypeError(
                    f"stage {self.index} takes {wanted} tensors for its inputs "
                    f"({', '.join(self.input_names)}), got {len(args)}"
                )
            args = tuple(from_wire(args, self._wires_in))
        elif len(args) != len(self.input_names):
            raise TypeError(
                f"stage {self.index} takes {len(self.input_names)} values "
                f"({', '.join(self.input_names)}), got {len(args)}"
            )
        if self.checkpoint and torch.is_grad_enabled() and self._node_unit is not None:
            # Per unit: each unit keeps its inputs and is re-computed on its own.
            out = args
            modules = list(self.body.modules())
            for unit in self.units():
                out = checkpointed(unit, out, modules)
        elif self.checkpoint and torch.is_grad_enabled():
            # The runtime's re-materialization: BatchNorm statistics are put back after the
            # recomputation, so they move once per micro-batch, not twice.
            out = checkpointed(self.body, args, list(self.body.modules()))
        else:
            out = self.body(*args)
        if not self.output_names:
            return self._flat_output(out)
        sent: list[torch.Tensor] = []
        for name, value in zip(self.output_names, out, strict=True):
            try:
                wire_of(value)
            except TypeError as exc:
                raise TypeError(
                    f"value {name!r} crossing the cut after stage {self.index} holds {exc}, "
                    "not a tensor or number; torch.distributed.pipelining sends only tensors "
                    "between stages: plan a different cut"
                ) from None
            tensors = [_plain(t) for t in to_wire(value)]
            if self.own_outputs:
                used = name in self._used_inside
                tensors = [t.clone() if used or t._is_view() else t for t in tensors]
            sent += tensors
        return tuple(sent)

    def adopt_node(self, new: str, old: str) -> None:
        """Graph node ``new`` now computes what node ``old`` did (a rewrite of the body, e.g.
        an inlined module called as a module again): it belongs to ``old``'s unit. Before
        the first forward (the units are cut then)."""
        if self._node_unit is not None and old in self._node_unit:
            self._node_unit[new] = self._node_unit[old]

    def compile_body(self) -> None:
        """Run the stage ``torch.compile``'d from now on, as a trainer compiling its stages
        does (fixed shapes): the graph in place (``nn.Module.compile``: parameter names and
        state dict unchanged; called after tensor parallelism and FSDP are applied, as
        torchtitan orders them), and, re-materialized per unit, each unit's function."""
        self.body.compile(dynamic=False)
        self.compiled = True

    def units(self) -> list[Callable[..., Any]]:
        """The stage's units' functions (:func:`autopipe.runtime.split.split_units`: each
        reads the stage's modules and parameters when called, so tensor parallelism and FSDP
        applied to them are what runs), cut at the first per-unit forward."""
        if self._units is None:
            self._units = split_units(self._stage, self._node_unit or {})
            if self.compiled:
                self._units = [torch.compile(unit, dynamic=False) for unit in self._units]
        return self._units

    def _flat_output(self, out: Any) -> Any:
        """The last stage's output as torch.distributed.pipelining wants it (a tensor or a
        tuple of tensors); :meth:`model_output` rebuilds the model's own structure."""
        value = self._unflatten(out) if self._unflatten is not None else out
        if isinstance(value, torch.Tensor):
            self._output_spec = None
            return value
        leaves, spec = pytree.tree_flatten(value)
        self._output_spec = spec
        self._output_constants = [None if isinstance(v, torch.Tensor) else v for v in leaves]
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    def model_output(self, flat: Any) -> Any:
        """The model's own output (e.g. a ModelOutput) from the last stage's flat output."""
        spec = getattr(self, "_output_spec", None)
        if spec is None:
            return flat
        tensors = iter(flat if isinstance(flat, (tuple, list)) else (flat,))
        leaves = [next(tensors) if c is None else c for c in self._output_constants]
        return pytree.tree_unflatten(leaves, spec)

    def model_named_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under their names in the original model."""
        return {name: p for name, p in self.body.named_parameters()}
