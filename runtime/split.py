"""Cut a traced graph into pipeline stages that talk only to their neighbours.

Both runtimes hand values from stage ``k`` to stage ``k + 1`` only: the single-process
executor passes each stage's outputs to the next stage, and
``torch.distributed.pipelining.PipelineStage`` receives every input from the previous rank.
A skip connection from stage 0 to stage 2 (or a model input used by a late stage) is
therefore *relayed* through stage 1: stage ``k``'s graph takes exactly the values live
across the cut before it, in graph order, and returns exactly the values live across the
cut after it (values it does not touch are passed through unchanged). Stage 0 takes the
model's inputs (every placeholder, in order); the last stage returns the model's output
(the original graph's output structure). ``torch.fx.passes.split_module`` is not used
because its submodules read their inputs from any earlier submodule.

Cost: O(nodes + edges x stages). Each stage's ``GraphModule`` holds only the submodules and
attributes its nodes use (the same module objects as the model, not copies).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.profiler.units import live_across_cuts
from torch import fx, nn

from autopipe.core.errors import UsageError

__all__ = ["StageGraph", "StageSplitError", "shared_parameters", "split_graph", "split_units"]

_NOT_CALLS = ("placeholder", "get_attr", "output")


class StageSplitError(UsageError, ValueError):
    """The stage assignment cannot be applied to this traced graph."""


@dataclass
class StageGraph:
    """One stage: ``module(*inputs) -> tuple(outputs)`` (the model's output on the last stage).

    ``input_names``/``output_names`` are the fx node names of the values crossing the cut
    before/after the stage, in the order they are passed (``output_names`` is empty on the
    last stage).
    """

    index: int
    module: fx.GraphModule
    input_names: list[str]
    output_names: list[str]


def _stage_of(graph: fx.Graph, node_stage: Mapping[str, int], num_stages: int) -> dict[str, int]:
    """Stage of every placeholder (0) and call node; checks coverage and that none is empty."""
    where: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            where[node.name] = 0
        elif node.op not in _NOT_CALLS:
            if node.name not in node_stage:
                raise StageSplitError(
                    f"graph node {node.name!r} has no stage; node_stage must cover every call node"
                )
            where[node.name] = node_stage[node.name]
    used = {where[n.name] for n in graph.nodes if n.op not in _NOT_CALLS}
    missing = sorted(set(range(num_stages)) - used)
    outside = sorted(used - set(range(num_stages)))
    if missing or outside:
        problems = [f"stages {missing} have no graph nodes"] if missing else []
        problems += [f"stages {outside} are outside [0, {num_stages})"] if outside else []
        raise StageSplitError("; ".join(problems) + "; every stage needs at least one operation")
    return where


def split_graph(
    graph_module: fx.GraphModule, node_stage: Mapping[str, int], num_stages: int
) -> list[StageGraph]:
    """Extract every stage graph (see the module docstring).

    ``node_stage`` gives every call node a stage in ``[0, num_stages)`` (placeholders are
    stage 0 and ``get_attr`` nodes go with their users whatever it says); stages must not
    decrease along data edges. Raises :class:`StageSplitError` otherwise.
    """
    gm = graph_module
    where = _stage_of(gm.graph, node_stage, num_stages)
    cuts = live_across_cuts(gm.graph, where, num_stages)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    by_name = {n.name: n for n in gm.graph.nodes}
    return [
        _stage_graph(gm, k, num_stages, where, cuts, placeholders, by_name, output_node)
        for k in range(num_stages)
    ]


def _stage_graph(
    gm: fx.GraphModule,
    k: int,
    num_stages: int,
    where: Mapping[str, int],
    cuts: list[list[str]],
    placeholders: list[str],
    by_name: Mapping[str, fx.Node],
    output_node: fx.Node,
) -> StageGraph:
    """Stage ``k``'s graph: its inputs (the model's arguments, or the cut before it) as
    placeholders, its nodes copied, the cut after it (or the model's output) as output."""
    inputs = placeholders if k == 0 else cuts[k - 1]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(n: fx.Node, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
        return env[n]

    for name in inputs:
        source = by_name[name]
        if k == 0:
            # The model's own argument (its name, e.g. ``input`` where fx named the node
            # ``input_1``, and its default value).
            new = graph.node_copy(source)
        else:
            new = graph.placeholder(name)
            new.meta = dict(source.meta)
        env[source] = new
    _copy_stage_nodes(gm.graph, graph, env, lookup, k, num_stages, where)
    if k == num_stages - 1:
        graph.output(fx.map_arg(output_node.args[0], lookup))
        outputs: list[str] = []
    else:
        outputs = cuts[k]
        graph.output(tuple(env[by_name[name]] for name in outputs))
    if k > 0:
        _clone_written_inputs(graph, gm)
    graph.lint()
    module = fx.GraphModule(gm, graph, class_name=f"Stage{k}")
    return StageGraph(k, module, list(inputs), list(outputs))


def _copy_stage_nodes(
    source: fx.Graph,
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    lookup: Callable[[fx.Node], fx.Node],
    k: int,
    num_stages: int,
    where: Mapping[str, int],
) -> None:
    """Copy stage ``k``'s call nodes, and the ``get_attr`` nodes its nodes read, into
    ``graph`` in order; StageSplitError for a node that reads a later stage's value."""
    for node in source.nodes:
        if node.op in ("placeholder", "output") or node in env:
            continue
        if node.op == "get_attr":
            last = num_stages - 1  # the output node belongs to the last stage
            if any((last if u.op == "output" else where[u.name]) == k for u in node.users):
                env[node] = graph.node_copy(node, lookup)
            continue
        if where[node.name] != k:
            continue
        try:
            env[node] = graph.node_copy(node, lookup)
        except KeyError as exc:
            raise StageSplitError(
                f"node {node.name!r} in stage {k} reads {exc.args[0]} from a later stage; "
                "stages must not decrease along data edges (the unit order is not topological)"
            ) from None


def split_units(stage: StageGraph, node_unit: Mapping[str, int]) -> list[Callable[..., Any]]:
    """The stage's graph cut into its units' functions, in model order, for per-unit
    re-materialization: the first takes the stage's inputs, each next one the previous one's
    outputs, and the last returns the stage's own output, so calling them in turn is calling
    the stage. ``node_unit`` maps the whole graph's call nodes to their units
    (``UnitGraph.node_unit``); the stage graph keeps those node names, and a node added
    since (the copy of an input the stage writes into, a tensor-parallel module call that
    replaced a traced ``linear``) goes with the latest unit it reads from (the first, when it
    reads only the stage's inputs). A unit without
    operations of its own is merged into its neighbours. Each function interprets its unit's
    graph against the stage module itself, reading its submodules and parameters at call
    time, so what FSDP, tensor parallelism or tied replicas put there later is what runs.
    O(nodes + edges x units)."""
    calls = [n for n in stage.module.graph.nodes if n.op not in _NOT_CALLS]
    known = [node_unit[n.name] for n in calls if n.name in node_unit]
    if not known:
        return [stage.module]
    local: dict[str, int] = {}
    for n in calls:  # in graph order: a node's inputs are placed before it
        if n.name in node_unit:
            local[n.name] = node_unit[n.name]
        else:  # added after tracing: with the latest unit it reads from
            inputs = [local[a.name] for a in n.all_input_nodes if a.name in local]
            local[n.name] = max(inputs, default=min(known))
    order = {u: k for k, u in enumerate(sorted(set(local.values())))}
    parts = {name: order[u] for name, u in local.items()}
    return [
        partial(_interpret, stage.module, g.module.graph)
        for g in split_graph(stage.module, parts, len(order))
    ]


def _interpret(module: fx.GraphModule, graph: fx.Graph, *args: Any) -> Any:
    """``graph`` run on ``args`` with its attributes and submodules read from ``module``."""
    return fx.Interpreter(module, graph=graph).run(*args, enable_io_processing=False)


# Methods and functions whose result is a view of their first argument: writing into the
# view writes into the argument.
_VIEW_METHODS = frozenset(
    "view view_as reshape reshape_as transpose permute t narrow select squeeze unsqueeze "
    "expand expand_as flatten unflatten unbind split chunk movedim swapaxes diagonal "
    "as_strided detach contiguous __getitem__".split()
)
_VIEW_FUNCTIONS = frozenset(
    [operator.getitem, torch.flatten, torch.transpose, torch.reshape, torch.narrow]
    + [torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.unbind, torch.permute]
)
_INPLACE_OPERATORS = frozenset(
    [operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv]
    + [operator.ipow, operator.imod, operator.iand, operator.ior, operator.ixor]
)


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value may alias its first argument."""
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if node.target in _VIEW_FUNCTIONS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _written_args(node: fx.Node, root: fx.GraphModule | None) -> list[fx.Node]:
    """The nodes whose value ``node`` writes into in place."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.kwargs.get("inplace") is True and first is not None:
        return [first]  # F.relu(x, inplace=True) and friends
    if node.op == "call_method":
        name = str(node.target)
        writes = name.endswith("_") and not name.endswith("__")
        return [first] if writes and first is not None else []
    if node.op == "call_module" and root is not None and first is not None:
        module = root.get_submodule(str(node.target))
        return [first] if getattr(module, "inplace", False) is True else []
    if node.op != "call_function":
        return []
    if node.target in _INPLACE_OPERATORS:
        return [first] if first is not None else []
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        written = []
        for position, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is None or not alias.is_write:
                continue
            value = (
                node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            )
            if isinstance(value, fx.Node):
                written.append(value)
        return written
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__") and first is not None:
        return [first]  # torch.relu_(x), torch.sigmoid_(x), ...
    return []


def _clone_written_inputs(graph: fx.Graph, root: fx.GraphModule | None = None) -> list[str]:
    """Give a stage its own copy of every input it writes into in place (directly or through
    a view), inserted after the placeholder (or the ``getitem`` taking it out of a tuple).

    Both runtimes hand a stage its inputs as autograd leaves, and autograd refuses an
    in-place write into a leaf that requires grad (the unsplit model writes into a non-leaf
    there and trains fine); the copy is a non-leaf whose gradient still reaches the leaf.
    Returns the names of the copied values. O(nodes).
    """
    root_of: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            root_of[node] = node
        elif _is_view(node) and node.args and node.args[0] in root_of:
            root_of[node] = root_of[node.args[0]]
    written: list[fx.Node] = []
    for node in graph.nodes:
        for target in _written_args(node, root):
            origin = root_of.get(target)
            if origin is not None and origin not in written:
                written.append(origin)
    for origin in written:
        with graph.inserting_after(origin):
            copy = graph.call_function(own_copy, (origin,))

        def not_the_copy(user: fx.Node, c: fx.Node = copy) -> bool:
            return user is not c

        origin.replace_all_uses_with(copy, delete_user_cb=not_the_copy)
    return [n.name for n in written]


def own_copy(value: Any) -> Any:
    """``value`` with every tensor in it cloned (a tensor, or a tuple/list of them)."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def shared_parameters(stages: Sequence[nn.Module]) -> Iterator[tuple[int, str, int, str]]:
    """``(first_stage, first_name, stage, name)`` for every use of a parameter by a stage after
    the first stage that uses it (tied weights split across stages). O(parameters)."""
    owner: dict[int, tuple[int, str]] = {}
    for j, module in enumerate(stages):
        for name, param in module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), (j, name))
            if first[0] != j:
                yield first[0], first[1], j, name
