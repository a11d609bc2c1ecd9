"""Cut a traced model into pipeline stages that talk only to their neighbours.

``torch.distributed.pipelining.PipelineStage`` receives every input of stage ``k`` from stage
``k - 1`` and sends every output to stage ``k + 1``. A skip connection from stage 0 to stage 2
(or a model input used by a late stage) must therefore be *relayed* through stage 1. That is
why this module extracts each stage graph itself instead of using
``torch.fx.passes.split_module`` (whose submodules read their inputs from any earlier
submodule): stage ``k``'s graph takes exactly the values live across the cut before it, in
graph order, and returns exactly the values live across the cut after it (values it does not
touch are passed through unchanged). Stage 0 takes the model's inputs, in ``forward``'s order;
the last stage returns the model's output.

Cost: O(nodes + edges) per stage. Each stage's ``GraphModule`` holds only the submodules and
attributes its nodes use, so dropping the full model afterwards frees the other stages'
parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from autopipe.profiler.units import UnitGraph
from torch import fx, nn
from torch.utils.checkpoint import checkpoint


class StageSplitError(ValueError):
    """The plan cannot be applied to this model's traced graph."""


@dataclass
class StageGraph:
    """One stage: ``module(*inputs) -> tuple(outputs)`` (the model's output on the last stage).

    ``input_names``/``output_names`` are the fx node names of the values crossing the cut
    before/after the stage, in the order they are passed.
    """

    index: int
    module: fx.GraphModule
    input_names: list[str]
    output_names: list[str]


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


def _node_stages(unit_graph: UnitGraph, unit_stage: Sequence[int]) -> dict[str, int]:
    return {name: unit_stage[u] for name, u in unit_graph.node_unit.items()}


def cut_values(unit_graph: UnitGraph, unit_stage: Sequence[int]) -> list[list[str]]:
    """For each cut ``k`` (after stage ``k``), the node names live across it, in graph order.

    A value is live across cut ``k`` if it is produced by stage ``<= k`` (placeholders count as
    stage 0) and used by a stage ``> k`` or by the graph's output. Parameters (``get_attr``) are
    never sent: each stage owns the attributes it uses.
    """
    num_stages = max(unit_stage) + 1
    where = _node_stages(unit_graph, unit_stage)
    cuts: list[list[str]] = [[] for _ in range(num_stages - 1)]
    for node in unit_graph.graph_module.graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        users = [num_stages - 1 if u.op == "output" else where[u.name] for u in node.users]
        if not users:
            continue
        for k in range(where[node.name], max(users)):
            cuts[k].append(node.name)
    return cuts


def _check_no_shared_parameters(stages: list[StageGraph]) -> None:
    """Tied weights used by two stages would be silently duplicated: refuse them."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in stages:
        for name, param in stage.module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), (stage.index, name))
            if first[0] != stage.index:
                raise StageSplitError(
                    f"parameter {first[1]!r} is used by stage {first[0]} and as {name!r} by "
                    f"stage {stage.index} (tied weights); the distributed runtime keeps one copy "
                    "per stage, so plan with both users in one stage or untie the weights"
                )


def split_stages(unit_graph: UnitGraph, unit_stage: Sequence[int]) -> list[StageGraph]:
    """Extract every stage graph (see the module docstring). ``unit_stage[u]`` is the stage of
    unit ``u``; it must be non-decreasing, start at 0 and have no gaps.
    """
    if list(unit_stage) != sorted(unit_stage) or unit_stage[0] != 0:
        raise StageSplitError("stages must be contiguous runs of units starting at stage 0")
    num_stages = max(unit_stage) + 1
    if sorted(set(unit_stage)) != list(range(num_stages)):
        raise StageSplitError("every stage needs at least one unit")
    gm = unit_graph.graph_module
    where = _node_stages(unit_graph, unit_stage)
    cuts = cut_values(unit_graph, unit_stage)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    by_name = {n.name: n for n in gm.graph.nodes}

    stages: list[StageGraph] = []
    for k in range(num_stages):
        inputs = placeholders if k == 0 else cuts[k - 1]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}

        def lookup(n: fx.Node, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
            return env[n]

        for name in inputs:
            source = by_name[name]
            new = graph.placeholder(name)
            new.meta = dict(source.meta)
            env[source] = new
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output") or node in env:
                continue
            if node.op == "get_attr":
                if any(u.op != "output" and where[u.name] == k for u in node.users):
                    env[node] = graph.node_copy(node, lookup)
                continue
            if where[node.name] != k:
                continue
            try:
                env[node] = graph.node_copy(node, lookup)
            except KeyError as exc:
                raise StageSplitError(
                    f"node {node.name!r} in stage {k} reads {exc.args[0]} which is not "
                    "available there; the unit order is not topological"
                ) from None
        if k == num_stages - 1:
            graph.output(torch.fx.map_arg(output_node.args[0], lookup))
            outputs: list[str] = []
        else:
            outputs = cuts[k]
            graph.output(tuple(env[by_name[name]] for name in outputs))
        graph.lint()
        module = fx.GraphModule(gm, graph, class_name=f"Stage{k}")
        stages.append(StageGraph(k, module, list(inputs), list(outputs)))
    _check_no_shared_parameters(stages)
    return stages


class StageModule(nn.Module):
    """One stage's graph, optionally re-materialized (activation checkpointing).

    With ``checkpoint=True`` the forward runs under ``torch.utils.checkpoint`` (non-reentrant,
    RNG state preserved): only the stage's inputs are kept for backward and the stage's
    forward is recomputed during its backward, GPipe's re-materialization. Parameter names
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
            out = checkpoint(self.body, *args, use_reentrant=False)
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
