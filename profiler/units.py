"""Group the nodes of a traced model into units: the atoms a pipeline plan cuts between.

Granularity (``trace_units(..., granularity=...)``):

- ``"module"``: the children of the top module, recursing into containers
  (``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict``), so a transformer's blocks
  become units.
- ``"block"`` (default): one unit per child of each container (ModuleList / Sequential /
  ModuleDict) of repeated blocks (e.g. ``transformer.h.0``; both stacks of an
  encoder-decoder, ``encoder.block.0`` and ``decoder.block.0``; every ``layerN`` of a
  ResNet), plus every module beside the paths to those containers as its own unit
  (embeddings before, final norm and head after). Without a repeated block it equals
  ``"module"``.
- ``"node"``: one unit per fx call node.

``units=["model.layers.*", ...]`` (fnmatch patterns over module paths) names the units
instead: every matching module (the outermost of nested matches) is a unit, and so is every
module beside the paths to them. The plan's unit names are module paths, so the runtime
re-traces into exactly the plan's units by passing them (:func:`unit_module`) as ``units``.

**Call sites.** A unit is one *call* of its module. A module with parameters that the model
calls several times (parameters shared across depth: ALBERT's one layer applied
``num_hidden_layers`` times, a block in a Python loop) is one unit per call (a
parameter-free one, e.g. a dropout called twice, stays one unit whose later calls join the
unit they run in): the first call is named by the module path,
the ``k``-th further call ``path#k`` (``albert.encoder.albert_layer_groups.0#3``), ``k`` being
torch's own call count (the ``@k`` of the tracer's ``nn_module_stack``). Those units hold
the same parameters: each names them in ``shared_parameters`` (a tied parameter, counted
once in the model's totals), and a cut between two calls ties them across stages.

Free functions between modules (e.g. the ``add`` of token and position embeddings) join the
unit of the next module node (the previous one at the end). Unit indices never decrease along
a data edge, so every contiguous split of ``unit_names`` is a valid cut of the graph.
Cost: O(nodes x module depth) to label, O(edges) to enforce the order.
"""

from __future__ import annotations

import fnmatch
import operator
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils._pytree as pytree
from autopipe.profiler.inputs import InputBinder
from autopipe.profiler.trace import batch_is_dynamic, trace_model
from torch import fx, nn

from autopipe.core.errors import UsageError

__all__ = [
    "CALL_SEPARATOR",
    "GRANULARITIES",
    "UnitGraph",
    "UnitPatternError",
    "cut_tensors",
    "live_across_cuts",
    "trace_units",
    "unit_module",
]

GRANULARITIES = ("block", "module", "node")

CALL_SEPARATOR = "#"
"""Between a module path and its call count in the name of a further call's unit
(``blocks.0#2``: the third call of ``blocks.0``). Module paths never contain it."""


def unit_module(name: str) -> str:
    """The module path of a unit name: ``name`` without its call count (``blocks.0#2`` ->
    ``blocks.0``); a module's first call, glue and node units unchanged. O(len(name))."""
    path, sep, count = name.rpartition(CALL_SEPARATOR)
    return path if sep and count.isdigit() else name


def _call_name(path: str, call: int) -> str:
    return path if call == 0 else f"{path}{CALL_SEPARATOR}{call}"


class UnitPatternError(UsageError, ValueError):
    """A ``units`` pattern matches no module of the model."""


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class UnitGraph:
    """A traced model with every node assigned to a unit (see module docstring)."""

    graph_module: fx.GraphModule
    unit_names: list[str]
    """Units in topological order: module paths (``blocks.3``; ``path#k`` for the ``k``-th
    further call of a module called several times) or, at node granularity, node names."""
    node_unit: dict[str, int]
    """fx node name -> unit index, for every node but the output (placeholders -> 0,
    get_attr -> unit of their first user)."""
    tracer: str
    """``"fx"``, ``"export"`` or ``"hooks"``."""
    unit_kinds: list[str]
    """Class name of each unit's module (function/method name at node granularity)."""
    granularity: str = "block"
    binder: InputBinder | None = None
    """Binds a call's ``(args, kwargs)`` to the graph's placeholder values."""
    unit_patterns: list[str] | None = None
    """The ``units`` patterns the units were chosen by, if any."""

    @property
    def batch_dynamic(self) -> bool:
        """Whether the graph runs at any batch size (False: an export graph whose batch
        dimension export specialised or guards, or a hooks graph; run it only at the traced
        batch size). :func:`autopipe.profiler.trace.batch_is_dynamic` of the graph."""
        return batch_is_dynamic(self.graph_module)

    def flat_inputs(self, example_inputs: Any) -> list[Any]:
        """Values for the graph's placeholders, in order, from the example-inputs convention.

        ``split_module(graph_module, ...)`` results take exactly these positional values.
        """
        assert self.binder is not None
        return self.binder.flat(example_inputs)

    def unflatten_output(self, flat_output: Any) -> Any:
        """Restore the model's output structure from the graph's output value (export graphs
        return a flat tuple once split); identity for fx/hooks graphs."""
        info = getattr(self.graph_module.graph._codegen, "pytree_info", None)
        if info is None or info.out_spec is None:
            return flat_output
        return pytree.tree_unflatten(list(flat_output), info.out_spec)

    @property
    def num_units(self) -> int:
        return len(self.unit_names)

    def nodes_of(self, unit: int) -> list[fx.Node]:
        """The call nodes (not placeholders/get_attr/output) of one unit, in graph order."""
        return [
            n
            for n in self.graph_module.graph.nodes
            if n.op not in ("placeholder", "get_attr", "output") and self.node_unit[n.name] == unit
        ]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, _CONTAINERS)


def _module_units(model: nn.Module, prefix: str = "") -> list[str]:
    """Children of ``model``, recursing into containers (``"module"`` granularity)."""
    paths: list[str] = []
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if _is_container(child) and len(list(child.children())) > 0:
            paths += _module_units(child, f"{path}.")
        else:
            paths.append(path)
    return paths


def _repeated_containers(model: nn.Module) -> list[tuple[tuple[int, int, int], str, type]]:
    """Containers of repeated blocks: ``(key, path, block class)``, best first.

    Candidates: containers with >= 2 children of one class, and any non-empty ModuleList (a
    one-block ModuleList is still the block list). The key ranks by the parameters in the
    children of the most common class (blocks hold the weights; a block's inner
    ``nn.Sequential`` of two Linears must not beat a one-block list), then the number of such
    children, then the shallowest path.
    """
    found: list[tuple[tuple[int, int, int], str, type]] = []
    for path, module in model.named_modules():
        if not _is_container(module):
            continue
        children = list(module.children())
        if not children:
            continue
        cls, count = Counter(type(c) for c in children).most_common(1)[0]
        if count < 2 and not isinstance(module, nn.ModuleList):
            continue
        params = sum(p.numel() for c in children if type(c) is cls for p in c.parameters())
        found.append(((params, count, -path.count(".")), path, cls))
    found.sort(key=lambda item: item[0], reverse=True)
    return found


def _block_container(model: nn.Module) -> str | None:
    """Path of the main container of repeated blocks (the one holding the most block
    parameters), or None. See :func:`_block_containers` for all of them."""
    ranked = _repeated_containers(model)
    return ranked[0][1] if ranked else None


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(f"{ancestor}.")


def _block_containers(model: nn.Module, share: float = 0.1) -> list[str]:
    """Paths of the containers whose children are the blocks, in module order.

    The best container (see :func:`_repeated_containers`) sets the block class; every other
    container not nested in (or around) a chosen one is chosen too when its blocks are of
    that class (T5's encoder and decoder stacks, a ResNet's ``layer1``..``layer4``) or hold
    at least ``share`` of the model's parameters (encoder and decoder layers of different
    classes). O(modules x chosen).
    """
    ranked = _repeated_containers(model)
    if not ranked:
        return []
    total = sum(p.numel() for p in model.parameters())
    block_cls = ranked[0][2]
    chosen: list[str] = []
    for (params, _count, _depth), path, cls in ranked:
        if any(_inside(path, c) or _inside(c, path) for c in chosen):
            continue
        if not chosen or cls is block_cls or (total and params >= share * total):
            chosen.append(path)
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return sorted(chosen, key=order.__getitem__)


def _units_around(module: nn.Module, units: set[str], prefix: str = "") -> list[str]:
    """``units`` (module paths) plus every module beside the paths from the root to them,
    in module order. O(modules x depth)."""
    paths: list[str] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path in units:
            paths.append(path)
        elif any(u.startswith(f"{path}.") for u in units):
            paths += _units_around(child, units, f"{path}.")
        else:
            paths.append(path)
    return paths


def _block_units(model: nn.Module) -> list[str]:
    """The children of every block container plus every module beside the paths to them."""
    containers = _block_containers(model)
    if not containers:
        return _module_units(model)
    if containers == [""]:
        return [name for name, _ in model.named_children()]
    blocks = {
        f"{path}.{name}"
        for path in containers
        for name, _ in model.get_submodule(path).named_children()
    }
    return _units_around(model, blocks)


def _pattern_units(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Units named by fnmatch ``patterns`` over module paths (see the module docstring).

    ``UnitPatternError`` if a pattern matches no module, naming a few real paths.
    """
    paths = [path for path, _ in model.named_modules() if path]
    matched: list[str] = []
    for pattern in patterns:
        hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            sample = ", ".join(paths[:4]) + (", ..." if len(paths) > 4 else "")
            raise UnitPatternError(
                f"--units pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"module paths look like: {sample}"
            )
        matched += hits
    outermost = {p for p in matched if not any(_inside(p, q) and p != q for q in matched)}
    return _units_around(model, outermost)


def _module_path(node: fx.Node) -> str | None:
    """Deepest module path of a node: its own target for ``call_module``, else the stack."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]


def _call_of(node: fx.Node, path: str) -> int:
    """Which call of the module at ``path`` ``node`` belongs to (0: the first), from the
    ``@k`` torch's tracers append to the ``nn_module_stack`` key of a module's further calls
    (``blocks.0@2`` under fx, ``L__self__blocks.0@2`` under export). O(module depth)."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        if isinstance(value, tuple) and value and value[0] == path:
            count = str(key).rpartition("@")[2] if "@" in str(key) else ""
            return int(count) if count.isdigit() else 0
    return 0


def _unit_of_path(path: str | None, units: set[str]) -> str | None:
    """The unit path that is ``path`` or its closest ancestor, or None for glue."""
    while path:
        # fx and export both record dotted qualified paths ("blocks.0.attn") here.
        if path in units:
            return path
        path = path.rpartition(".")[0] if "." in path else ""
    return "" if "" in units else None


def _node_kind(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def _assign(gm: fx.GraphModule, labels: dict[str, str | None]) -> tuple[list[str], dict[str, int]]:
    """Order units by first appearance, attach glue nodes, enforce producer <= consumer."""
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    order: list[str] = []
    for n in calls:
        label = labels[n.name]
        if label is not None and label not in order:
            order.append(label)
    if not order:
        order = [type(gm).__name__ if calls else "model"]
        labels = {n.name: order[0] for n in calls}
    index = {name: i for i, name in enumerate(order)}

    # Glue: the unit of the next labelled node (the previous at the end).
    unit: dict[str, int] = {}
    pending: list[fx.Node] = []
    last = 0
    for n in calls:
        label = labels[n.name]
        if label is None:
            pending.append(n)
            continue
        last = index[label]
        for g in pending:
            unit[g.name] = last
        pending.clear()
        unit[n.name] = last
    for g in pending:
        unit[g.name] = last

    for n in nodes:
        if n.op == "placeholder":
            unit[n.name] = 0
    # A node reached from a later unit (e.g. a module reused after other modules) moves into
    # that later unit: indices must not decrease along data edges.
    for n in calls:
        producers = [unit[p.name] for p in n.all_input_nodes if p.op != "get_attr"]
        if producers:
            unit[n.name] = max(unit[n.name], *producers)
    for n in nodes:
        if n.op == "get_attr":
            users = [unit[u.name] for u in n.users if u.op != "output"]
            unit[n.name] = min(users) if users else 0
    # Units emptied by the move above are dropped and indices renumbered.
    used = sorted({unit[n.name] for n in calls}) or [0]
    renumber = {old: new for new, old in enumerate(used)}
    names = [order[i] for i in used]
    return names, {k: renumber.get(v, 0) for k, v in unit.items()}


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)}; pick one of those"
        )


def unit_graph_from(
    gm: fx.GraphModule,
    model: nn.Module,
    tracer: str,
    granularity: str = "block",
    units: Sequence[str] | None = None,
    example_inputs: Any = None,
) -> UnitGraph:
    """Group the nodes of an already traced ``gm`` (of ``model``) into units; ``units``
    (fnmatch patterns over module paths) overrides the granularity's choice."""
    _check_granularity(granularity)
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    by_node = granularity == "node" and not units
    labels: dict[str, str | None]
    if by_node:
        labels = {n.name: n.name for n in calls}
    else:
        labels = _module_labels(calls, model, granularity, units)
    names, node_unit = _assign(gm, labels)
    if by_node:
        by_name = {n.name: n for n in calls}
        kinds = [_node_kind(gm, by_name[u]) if u in by_name else "" for u in names]
    else:
        kinds = []
        for u in names:
            try:
                kinds.append(type(model.get_submodule(unit_module(u))).__name__)
            except AttributeError:
                kinds.append(type(model).__name__)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    in_spec = info.in_spec if info is not None else None
    return UnitGraph(
        graph_module=gm,
        unit_names=names,
        node_unit=node_unit,
        tracer=tracer,
        unit_kinds=kinds,
        granularity=granularity,
        binder=InputBinder.for_trace(model, example_inputs, placeholders, in_spec),
        unit_patterns=list(units) if units else None,
    )


def _module_labels(
    calls: list[fx.Node], model: nn.Module, granularity: str, units: Sequence[str] | None
) -> dict[str, str | None]:
    """Each call node's unit: the module (of the granularity's, or matching ``units``) it
    runs in, per call for a module with parameters; None for glue between units."""
    if units:
        paths = _pattern_units(model, units)
    else:
        paths = _block_units(model) if granularity == "block" else _module_units(model)
    unit_set = set(paths) or {""}
    modules = dict(model.named_modules())
    # Only a module with parameters is cut per call: a parameter-free one (a dropout or
    # an activation called twice) has nothing to share, and its later calls stay glue
    # of the unit they run in.
    per_call = {
        path
        for path in unit_set
        if path in modules and next(modules[path].parameters(), None) is not None
    }
    labels: dict[str, str | None] = {}
    for n in calls:
        path = _unit_of_path(_module_path(n), unit_set)
        if path is not None and path in per_call:
            path = _call_name(path, _call_of(n, path))
        labels[n.name] = path
    for n in calls:
        # Unpacking a unit's tuple output (``out, (h, c) = self.lstm(x)``) belongs to that
        # unit: only the parts used later cross a cut, not the whole tuple.
        if labels[n.name] is None and n.target is operator.getitem:
            source = n.args[0]
            if isinstance(source, fx.Node) and labels.get(source.name) is not None:
                labels[n.name] = labels[source.name]
    return labels


def trace_units(
    model: nn.Module,
    example_inputs: Any,
    granularity: str = "block",
    tracer: str | None = None,
    units: Sequence[str] | None = None,
) -> UnitGraph:
    """Trace ``model`` (fx, then export, then hooks) and group its nodes into units.

    ``example_inputs``: a tensor (one argument), a tuple (positional arguments) or a dict
    (keyword arguments). Nothing is executed except by the export/hooks fallbacks.
    ``tracer`` forces ``"fx"``, ``"export"`` or ``"hooks"`` instead of the fallback chain;
    ``units`` names the units by fnmatch patterns over module paths (``"model.layers.*"``).
    Raises :class:`TraceError` if no tracer works, ``ValueError`` for a bad granularity or a
    pattern that matches no module.
    """
    _check_granularity(granularity)
    if units:
        _pattern_units(model, units)  # a bad pattern fails before the costly trace
    gm, used = trace_model(model, example_inputs, tracer)
    return unit_graph_from(gm, model, used, granularity, units, example_inputs)


def cut_tensors(unit_graph: UnitGraph) -> list[list[str]]:
    """For each cut ``i`` (between unit ``i`` and ``i + 1``), the names of the nodes produced at
    units ``<= i`` and consumed at units ``> i`` (see :func:`live_across_cuts`)."""
    return live_across_cuts(
        unit_graph.graph_module.graph, unit_graph.node_unit, unit_graph.num_units
    )


def live_across_cuts(graph: fx.Graph, where: Mapping[str, int], num_parts: int) -> list[list[str]]:
    """For each cut ``k`` (after part ``k`` of a contiguous split), the node names live across
    it, in graph order: produced by part ``<= k`` and used by a part ``> k`` or by the graph's
    output (skip connections count). Parameters and buffers (``get_attr``) never cross a cut:
    each part owns what it uses. ``where`` maps every other node to its part. Shared by the
    profiler (cut bytes between units) and the runtime (what each stage sends).
    O(edges x parts) in the worst case.
    """
    cuts: list[list[str]] = [[] for _ in range(max(num_parts - 1, 0))]
    for node in graph.nodes:
        if node.op in ("get_attr", "output"):
            continue
        users = [num_parts - 1 if u.op == "output" else where[u.name] for u in node.users]
        for k in range(where[node.name], max(users, default=0)):
            cuts[k].append(node.name)
    return cuts
