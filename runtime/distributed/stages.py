"""A plan's stages of a traced model, one per rank, for ``torch.distributed.pipelining``.

The graph is cut with :func:`autopipe.runtime.split.split_graph` (the splitter the
single-process runtime uses too): ``PipelineStage`` receives every input of stage ``k`` from
stage ``k - 1``, so values that skip a stage are relayed through it. Here: the plan's units
mapped to stages, tied weights refused (each rank holds its own copy), and
:class:`StageModule`, one stage as a module with optional re-materialization.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from autopipe.profiler.units import UnitGraph
from autopipe.runtime.checkpoint import checkpointed
from autopipe.runtime.split import StageGraph, StageSplitError, shared_parameters, split_graph
from torch import nn

__all__ = ["StageGraph", "StageModule", "StageSplitError", "split_stages", "stage_of_unit"]


def stage_of_unit(unit_names: Sequence[str], stage_units: Sequence[Sequence[str]]) -> list[int]:
    """Map each unit index to its stage from the plan's per-stage unit lists.

    Raises :class:`StageSplitError` if the plan's units are not exactly ``unit_names`` cut
    into contiguous runs (the plan was made for another model or unit granularity).
    """
    flat = [u for units in stage_units for u in units]
    if list(flat) != list(unit_names):
        missing = [u for u in unit_names if u not in set(flat)][:3]
        extra = [u for u in flat if u not in set(unit_names)][:3]
        raise StageSplitError(
            f"the plan's units do not match the model's {len(unit_names)} traced units "
            f"(plan has {len(flat)}; not in plan: {missing}, unknown to the model: {extra}); "
            "re-run `autopipe plan` on this model with the same --granularity"
        )
    stages: list[int] = []
    for index, units in enumerate(stage_units):
        if not units:
            raise StageSplitError(f"stage {index} of the plan has no units; re-run `autopipe plan`")
        stages += [index] * len(units)
    return stages


def _check_no_shared_parameters(stages: list[StageGraph]) -> None:
    """Tied weights used by two stages would be silently duplicated: refuse them."""
    for first, first_name, stage, name in shared_parameters([s.module for s in stages]):
        raise StageSplitError(
            f"parameter {first_name!r} is used by stage {first} and as {name!r} by "
            f"stage {stage} (tied weights); the distributed runtime keeps one copy "
            "per stage, so plan with both users in one stage or untie the weights"
        )


def split_stages(unit_graph: UnitGraph, unit_stage: Sequence[int]) -> list[StageGraph]:
    """Every stage graph of the plan (see :func:`autopipe.runtime.split.split_graph`).

    ``unit_stage[u]`` is the stage of unit ``u``; it must be non-decreasing, start at 0 and
    have no gaps. Parameters used by two stages are refused (:class:`StageSplitError`).
    """
    if list(unit_stage) != sorted(unit_stage) or unit_stage[0] != 0:
        raise StageSplitError("stages must be contiguous runs of units starting at stage 0")
    num_stages = max(unit_stage) + 1
    if sorted(set(unit_stage)) != list(range(num_stages)):
        raise StageSplitError("every stage needs at least one unit")
    node_stage = {name: unit_stage[u] for name, u in unit_graph.node_unit.items()}
    stages = split_graph(unit_graph.graph_module, node_stage, num_stages)
    _check_no_shared_parameters(stages)
    return stages


class StageModule(nn.Module):
    """One stage's graph, optionally re-materialized (activation checkpointing).

    With ``checkpoint=True`` the forward runs under ``torch.utils.checkpoint`` (non-reentrant,
    RNG state preserved, via :func:`autopipe.runtime.checkpoint.checkpointed`): only the
    stage's inputs are kept for backward and the stage's forward is recomputed during its
    backward, GPipe's re-materialization; BatchNorm statistics do not move in the recompute. Parameter names
    are the original model's, behind the ``body.`` prefix (see :meth:`model_named_parameters`).
    """

    def __init__(self, stage: StageGraph, checkpoint: bool = False) -> None:
        super().__init__()
        self.body = stage.module
        self.index = stage.index
        self.input_names = stage.input_names
        self.output_names = stage.output_names
        self.checkpoint = checkpoint

    def forward(self, *args: torch.Tensor) -> object:
        if len(args) != len(self.input_names):
            raise TypeError(
                f"stage {self.index} takes {len(self.input_names)} tensors "
                f"({', '.join(self.input_names)}), got {len(args)}"
            )
        if self.checkpoint and torch.is_grad_enabled():
            # The runtime's re-materialization: BatchNorm statistics are put back after the
            # recomputation, so they move once per micro-batch, not twice.
            out = checkpointed(self.body, args, list(self.body.modules()))
        else:
            out = self.body(*args)
        if self.output_names:
            for name, value in zip(self.output_names, out, strict=True):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(
                        f"value {name!r} crossing the cut after stage {self.index} is a "
                        f"Python {type(value).__name__}, not a tensor; torch.distributed.pipelining "
                        "sends only tensors between stages: plan a different cut"
                    )
        return out

    def model_named_parameters(self) -> dict[str, nn.Parameter]:
        """This stage's parameters under their names in the original model."""
        return {name: p for name, p in self.body.named_parameters()}
