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
    :meth:`model_named_parameters`). ``unflatten`` (last stage) restores the model's own
    output structure from the graph's flat output, so the loss sees e.g. a ModelOutput.
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
            return self._unflatten(out) if self._unflatten is not None else out
        sent = []
        for name, value in zip(self.output_names, out, strict=True):
            if isinstance(value, _NUMBERS):
                value = torch.tensor(value)  # numbers travel as 0-dim tensors
            elif not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"value {name!r} crossing the cut after stage {self.index} is a "
                    f"Python {type(value).__name__}, not a tensor or number; "
                    "torch.distributed.pipelining sends only tensors between stages: plan a "
                    "different cut"
                )
            sent.append(value)
        return tuple(sent)

    def model_named_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under their names in the original model."""
        return {name: p for name, p in self.body.named_parameters()}
