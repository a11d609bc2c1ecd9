"""One stage of a plan as a module for ``torch.distributed.pipelining``.

The stage graphs come from :func:`autopipe.runtime.partition.partition` (the route the
single-process runtime takes too): ``PipelineStage`` receives every input of stage ``k`` from
stage ``k - 1``, so values that skip a stage are relayed through it. Here:
:class:`StageModule`, one stage as a module with optional re-materialization, that also
carries Python numbers across a cut (a symbolic batch size, a sequence length) as 0-dim
tensors, since only tensors travel between ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.profiler.units import UnitGraph
from autopipe.runtime.checkpoint import checkpointed
from autopipe.runtime.partition import stage_of_unit
from autopipe.runtime.split import StageGraph, StageSplitError, split_graph
from torch import fx, nn

__all__ = ["StageGraph", "StageModule", "StageSplitError", "split_stages", "stage_of_unit"]

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


def _number_inputs(graph: fx.GraphModule) -> list[bool]:
    """Per placeholder: whether it carries a Python number (traced as a SymInt/int), which
    arrives as a 0-dim tensor and is turned back into a number."""
    flags = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            flags.append(isinstance(node.meta.get("val"), _NUMBERS))
    return flags


class StageModule(nn.Module):
    """One stage's graph, optionally re-materialized (activation checkpointing).

    With ``checkpoint=True`` the forward runs under ``torch.utils.checkpoint`` (non-reentrant,
    RNG state preserved, via :func:`autopipe.runtime.checkpoint.checkpointed`): only the
    stage's inputs are kept for backward and the stage's forward is recomputed during its
    backward, GPipe's re-materialization; BatchNorm statistics do not move in the recompute.
    Parameter names are the original model's, behind the ``body.`` prefix (see
    :meth:`model_named_parameters`). The last stage returns the tensors of the model's
    output, flat, as torch wants; ``unflatten`` restores the model's own structure from the
    graph's output, and :meth:`model_output` does so for the loss (e.g. a ModelOutput).
    """

    def __init__(
        self,
        stage: StageGraph,
        checkpoint: bool = False,
        unflatten: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        self.body = stage.module
        self.index = stage.index
        self.input_names = stage.input_names
        self.output_names = stage.output_names
        self.checkpoint = checkpoint
        self._unflatten = unflatten
        self._number_inputs = _number_inputs(stage.module) if stage.index > 0 else []

    def forward(self, *args: Any) -> Any:
        if len(args) != len(self.input_names):
            raise TypeError(
                f"stage {self.index} takes {len(self.input_names)} values "
                f"({', '.join(self.input_names)}), got {len(args)}"
            )
        if self._number_inputs:
            args = tuple(
                a.item() if number and isinstance(a, torch.Tensor) else a
                for a, number in zip(args, self._number_inputs, strict=True)
            )
        if self.checkpoint and torch.is_grad_enabled():
            # The runtime's re-materialization: BatchNorm statistics are put back after the
            # recomputation, so they move once per micro-batch, not twice.
            out = checkpointed(self.body, args, list(self.body.modules()))
        else:
            out = self.body(*args)
        if not self.output_names:
            return self._flat_output(out)
        sent = []
        for name, value in zip(self.output_names, out, strict=True):
            if isinstance(value, _NUMBERS):
                value = torch.tensor(value)  # numbers travel as 0-dim tensors
            elif isinstance(value, torch.Tensor):
                value = value.contiguous()  # gloo and NCCL send dense tensors only
            elif not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"value {name!r} crossing the cut after stage {self.index} is a "
                    f"Python {type(value).__name__}, not a tensor or number; "
                    "torch.distributed.pipelining sends only tensors between stages: plan a "
                    "different cut"
                )
            sent.append(value)
        return tuple(sent)

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
