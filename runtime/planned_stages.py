"""From (model, plan) to stage graphs: the one route both runtimes take.

``parallelize`` (one process, one stage per device) and ``DistributedPipeline`` (the V
chunks of each rank) both call :func:`partition`, which gives every one of the plan's
``K x V`` stage graphs (chunks), in model order:

1. trace the model into exactly the plan's units (:func:`trace_for_plan`): the plan's unit
   names are module paths (``path#k`` for a further call of a module called several times,
   ``autopipe.profiler.units``), so their modules are passed as the units to trace into;
   a graph whose
   batch dimension torch.export had to specialise (or guards, branches on, or holds only
   from 2 rows on: :func:`autopipe.profiler.trace.batch_is_dynamic`), or a hooks graph
   (one run's chain of children), is traced again at the plan's micro-batch size with the
   same tracer; a hooks chain that differs there is refused;
2. map each unit to its stage (:func:`stage_of_unit`, which also checks the plan's unit
   names fit), and check the model's parameters against the plan's record of them
   (:func:`check_plan_parameters`): a plan made for another model with the same unit names
   is refused before anything is built;
3. cut the graph into stage graphs (:func:`autopipe.runtime.split.split_graph`);
4. find the parameters several stages use (tied weights, :class:`TiedParameter`): each
   runtime keeps one logical parameter whose gradient is summed over the stages holding it.

Cost: one trace (two for a static export graph or a hooks graph) plus O(nodes + edges x stages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from autopipe.profiler.inputs import InputBinder, batch_rows, batch_size_of
from autopipe.profiler.memory import tensor_bytes, unit_tensors
from autopipe.profiler.objective import LabelItems
from autopipe.profiler.trace import batch_is_dynamic
from autopipe.profiler.units import GRANULARITIES, UnitGraph, trace_units, unit_module
from autopipe.runtime.split import StageGraph, StageSplitError, split_graph
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe.core.plan import Plan

__all__ = [
    "PlanModelMismatchError",
    "PlannedStages",
    "check_plan_parameters",
    "cut_values",
    "TiedParameter",
    "partition",
    "stage_of_unit",
    "tied_parameters",
    "trace_for_plan",
]


@dataclass
class TiedParameter:
    """One parameter used by more than one stage (e.g. GPT-2's embedding and LM head).

    ``stages`` ascending; ``names[stage]`` lists the qualified names under which that
    stage's module reaches it (one per module that holds it there).
    """

    name: str
    """Its first name in the model (``model.named_parameters()``)."""
    stages: list[int]
    names: dict[int, list[str]] = field(default_factory=dict)


@dataclass
class PlannedStages:
    """A plan applied to a traced model: what a runtime builds its stages from."""

    stages: list[StageGraph]
    binder: InputBinder
    """Model inputs ``(args, kwargs)`` -> stage 0's positional values."""
    unflatten_output: Callable[[Any], Any]
    """The last stage's value -> the model's own output structure (e.g. a ModelOutput)."""
    tied: list[TiedParameter]
    graph_module: fx.GraphModule
    """The whole traced graph the stages were cut from (for :func:`cut_values`)."""
    static_microbatch_size: int | None = None
    """Set when the graph only runs at this micro-batch size (export had to specialise the
    batch dimension); None when it runs at any."""
    label_items: LabelItems = field(default_factory=LabelItems)
    """How the model's own loss counts its items, which weight the micro-batches' losses
    (:mod:`autopipe.profiler.objective`)."""
    node_unit: dict[str, int] = field(default_factory=dict)
    """The traced graph's call nodes -> their unit (``UnitGraph.node_unit``): where a stage
    re-materialized per unit is cut (:func:`autopipe.runtime.split.split_units`)."""


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
            "re-run `autopipe plan` on this model with the same --granularity/--units"
        )
    stages: list[int] = []
    for index, units in enumerate(stage_units):
        if not units:
            raise StageSplitError(f"stage {index} of the plan has no units; re-run `autopipe plan`")
        stages += [index] * len(units)
    return stages


class PlanModelMismatchError(StageSplitError):
    """The model's parameters are not those the plan was made for (same unit names, another
    model: other widths, other layers)."""


def check_plan_parameters(graph: UnitGraph, model: nn.Module, plan: Plan) -> None:
    """Raise :class:`PlanModelMismatchError`, one line naming the first unit (or stage) that
    differs, unless ``model``'s parameters, counted per unit of ``graph`` (traced into the
    plan's units; :func:`stage_of_unit` has checked the names), are what the plan records.

    Counted as the profiler counts them (:func:`autopipe.profiler.memory.unit_tensors`): a
    tied parameter (GPT-2's embedding and head) in every unit that uses it. Shapes only, so
    a model on the meta device is checked too. Plans record each unit's parameter elements
    (``StagePlan.unit_parameters``); a stage without that record is checked by its
    ``parameter_bytes``, which must equal the model's bytes or its element count times the
    plan's ``parameter_size_bytes`` (an analytic profile counts at its own dtype);
    plans that record neither (hand-made, all ``parameter_bytes`` 0) are not checked.
    O(nodes + parameters).
    """
    per_unit = unit_tensors(graph, model)
    counts = [sum(p.numel() for p in params) for params, _ in per_unit]
    sizes_bytes = [sum(tensor_bytes(p) for p in params) for params, _ in per_unit]
    where = {name: i for i, name in enumerate(graph.unit_names)}
    made_for = f" (made for {plan.model})" if plan.model else ""
    advice = "re-run `autopipe plan` on this model"
    recorded_bytes = any(s.parameter_bytes > 0 for s in plan.stages)
    element_bytes = plan.parameter_size_bytes
    for index, stage in enumerate(plan.stages):
        recorded = list(stage.unit_parameters)
        if recorded:
            for unit, want in zip(stage.units, recorded, strict=True):
                have = counts[where[unit]]
                if have != want:
                    raise PlanModelMismatchError(
                        f"the plan{made_for} is not for this model: unit {unit!r} has "
                        f"{want:,} parameters in the plan but {have:,} in this model "
                        f"({type(model).__name__}); {advice}"
                    )
        elif recorded_bytes:
            units = [where[u] for u in stage.units]
            real_bytes = sum(sizes_bytes[u] for u in units)
            at_plan_size = sum(counts[u] for u in units) * element_bytes
            if stage.parameter_bytes not in (real_bytes, at_plan_size or real_bytes):
                span = (
                    stage.units[0]
                    if len(stage.units) == 1
                    else (f"{stage.units[0]}..{stage.units[-1]}")
                )
                raise PlanModelMismatchError(
                    f"the plan{made_for} is not for this model: stage {index} ({span}) holds "
                    f"{stage.parameter_bytes:,} bytes of parameters in the plan but "
                    f"{real_bytes:,} in this model ({type(model).__name__}); {advice}"
                )


def _plan_units(plan: Plan) -> list[str]:
    return [u for stage in plan.stages for u in stage.units]


def _trace_units_of(
    model: nn.Module, example_inputs: Any, plan: Plan, tracer: str | None = None
) -> UnitGraph:
    wanted = _plan_units(plan)
    granularity = plan.granularity
    if granularity not in GRANULARITIES:
        granularity = "block"
    paths = {path for path, _ in model.named_modules() if path}
    # A module called several times is one unit per call (``blocks.0``, ``blocks.0#1``, ...):
    # tracing into the module gives back every call's unit.
    modules = list(dict.fromkeys(unit_module(u) for u in wanted))
    if granularity != "node" and modules and all(u in paths for u in modules):
        # Module paths contain no glob characters: each name matches only itself.
        return trace_units(model, example_inputs, granularity, tracer, modules)
    return trace_units(model, example_inputs, granularity, tracer)


def trace_for_plan(model: nn.Module, example_inputs: Any, plan: Plan) -> UnitGraph:
    """Trace ``model`` into the plan's units at a batch size the plan's micro-batches run at.

    ``example_inputs`` hold a (local) mini-batch; the graph is batch-polymorphic when the
    tracer allows (and runs at ``plan.microbatch_size`` as the model does), else it is
    traced again on the first ``plan.microbatch_size`` rows.
    Tracing does not run the model with fx, so a model on the meta device works there.
    """
    graph = _trace_units_of(model, example_inputs, plan)
    size = int(plan.microbatch_size)
    if (
        not batch_is_dynamic(graph.graph_module, size)
        and size >= 1
        and batch_size_of(example_inputs) != size
    ):
        rows = batch_rows(example_inputs, 0, size)
        first, graph = graph, _trace_units_of(model, rows, plan, graph.tracer)
        _check_same_chain(model, first, graph, size)
    return graph


def _check_same_chain(model: nn.Module, first: UnitGraph, graph: UnitGraph, size: int) -> None:
    """Raise :class:`StageSplitError` when the hooks tracer saw ``model`` call other children
    at ``size`` rows (``graph``) than on the example batch (``first``, the plan's chain)."""
    if graph.tracer != "hooks":
        return
    chains = [
        [str(n.target) for n in g.graph_module.graph.nodes if n.op == "call_module"]
        for g in (first, graph)
    ]
    if chains[0] != chains[1]:
        raise StageSplitError(
            f"at micro-batch size {size} the forward of {type(model).__name__} runs the "
            f"children [{', '.join(chains[1])}], not the [{', '.join(chains[0])}] it ran on "
            "the example batch (forward picks children by the batch size, and the hooks "
            "tracer replays one run's chain); make forward call the same children at every "
            "batch size"
        )


def tied_parameters(
    modules: Sequence[nn.Module], model: nn.Module | None = None
) -> list[TiedParameter]:
    """The parameters that more than one of ``modules`` (the stages, in order) hold.
    O(parameters)."""
    first_name: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters():
            first_name.setdefault(id(p), name)
    found: dict[int, TiedParameter] = {}
    users: dict[int, dict[int, list[str]]] = {}
    for stage, module in enumerate(modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            users.setdefault(id(p), {}).setdefault(stage, []).append(name)
    for key, by_stage in users.items():
        if len(by_stage) < 2:
            continue
        stages = sorted(by_stage)
        name = first_name.get(key, by_stage[stages[0]][0])
        found[key] = TiedParameter(name, stages, {s: by_stage[s] for s in stages})
    return sorted(found.values(), key=lambda t: (t.stages, t.name))


def partition(
    model: nn.Module,
    example_inputs: Any,
    plan: Plan,
    *,
    check_parameters: bool = True,
    rewrite: Callable[[UnitGraph], object] | None = None,
) -> PlannedStages:
    """The plan's stage graphs of ``model`` (see the module docstring).

    Raises :class:`StageSplitError` when the plan does not fit the model
    (:class:`PlanModelMismatchError` when it was made for another one). With
    ``check_parameters=False`` the units' parameter counts are not compared to the plan's
    (the tensor-parallel re-trace of :mod:`autopipe.runtime.distributed.mesh`, whose split
    modules hold one rank's share). ``rewrite`` edits the traced graph in place before it
    is cut (context parallelism's attention calls, :mod:`.distributed.context_parallel`).
    """
    chunks = plan.num_stages * plan.virtual_stages
    if len(plan.stages) != chunks:
        raise StageSplitError(
            f"plan says num_stages x virtual_stages = {chunks} but lists {len(plan.stages)} stages"
        )
    graph = trace_for_plan(model, example_inputs, plan)
    if rewrite is not None:
        rewrite(graph)
    unit_stage = stage_of_unit(graph.unit_names, [s.units for s in plan.stages])
    if check_parameters:
        check_plan_parameters(graph, model, plan)
    node_stage = {name: unit_stage[u] for name, u in graph.node_unit.items()}
    stages = split_graph(graph.graph_module, node_stage, chunks)
    assert graph.binder is not None
    return PlannedStages(
        stages=stages,
        binder=graph.binder,
        unflatten_output=graph.unflatten_output,
        tied=tied_parameters([s.module for s in stages], model),
        graph_module=graph.graph_module,
        static_microbatch_size=None if graph.batch_dynamic else int(plan.microbatch_size),
        label_items=LabelItems.of(model),
        node_unit=dict(graph.node_unit),
    )


def cut_values(
    graph_module: fx.GraphModule, flat_inputs: Sequence[Any], names: set[str]
) -> dict[str, Any]:
    """The values of the nodes ``names`` (and the graph's output, under :data:`OUTPUT`)
    for one call on ``flat_inputs``, computed with fake
    tensors (``FakeTensorMode``: shapes, dtypes and ``requires_grad`` as in a real training
    forward, no data and no compute). Inputs are taken to the device of the graph's first
    parameter, so a model on the meta device works. Raises whatever the graph raises on fake
    tensors (data-dependent shapes).
    """
    device = next((p.device for p in graph_module.parameters()), None)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    found: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if n.name in names:
                found[n.name] = value
            return value

    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        moved = value.to(device) if device is not None and value.device != device else value
        return mode.from_tensor(moved)

    fakes = [fake(v) for v in flat_inputs]
    with mode, torch.enable_grad():
        found[OUTPUT] = Recorder(graph_module).run(*fakes, enable_io_processing=False)
    return found


OUTPUT = "<output>"
"""The key of the graph's output value in :func:`cut_values`' result."""
