"""Parameters that tensor parallelism leaves whole but that each TP rank applies to its own
share of the data: their gradient on one rank is partial and must be summed over the TP group.

Under a TP plan with sequence parallelism (:mod:`.sequence_parallel`), every value of the
traced graph is either the same on every TP rank (*replicated*: the inputs, a gathered LM
head's logits, a norm's gathered output) or *distinct* per rank: one rank's share of the
features or heads (a column-wise module's output and what is computed from it before the
row-wise module closing the region) or of the sequence (a row-wise module's reduce-scattered
output and the residual stream after it). The split modules, the sequence-parallel norms and
the transitions that shard a replicated value are torch's DTensor styles, whose backward
reduces what they must. Any other op that computes a distinct value from a parameter (or
from a value computed from parameters alone) sees only this rank's share, so the gradient it
gives that parameter is one rank's part of the whole: Qwen3's and Apertus's per-head
``q_norm`` / ``k_norm`` (after the column-wise ``q_proj``), Apertus's xIELU scalars (after
the column-wise ``up_proj``), a layer scale on the residual stream.

:func:`partial_gradient_parameters` finds them on the whole traced graph (the one the stages
are cut from); the distributed runtime sums their gradients over the TP group before the
optimizer step (the sum over ranks of the partial gradients is the whole gradient, as each
rank's part comes from its own share). A parameter that is also used on replicated values
(whose gradient there is already whole on every rank) cannot be made right by a sum: it is
refused in one line (:class:`SequenceParallelError`). Hugging Face's
``replicated_with_grad_allreduce`` plan entries (Qwen3's and Apertus's q/k norms) name such
parameters: the runtime leaves those modules whole and the graph, which sees every such
parameter whether or not the plan names it, says which to sum.

O(nodes x parameters per node).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from autopipe.runtime.distributed.sequence_parallel import (
    ROWWISE_STYLES,
    SequenceLayout,
    SequenceParallelError,
    _in_module,
    _is_shape_read,
    planned_path,
)
from torch import fx, nn
from torch.distributed.tensor import DTensor

__all__ = ["partial_gradient_parameters", "tp_summed_parameters"]

_GATHERED = "gathered over the sequence: "
"""Prefix of the name a gathered value is tracked by, as a parameter is (no parameter name
holds spaces)."""

_LOCAL_OUTPUT = ("colwise",)
"""Split styles whose output is one rank's share of the features (not gathered)."""


def _module_parameters(graph_module: fx.GraphModule, node: fx.Node) -> list[str]:
    """The parameters (full names) a ``call_module`` node's module holds, else []."""
    if node.op != "call_module":
        return []
    module = graph_module.get_submodule(str(node.target))
    return [f"{node.target}.{name}" for name, _ in module.named_parameters()]


def partial_gradient_parameters(
    graph_module: fx.GraphModule,
    planned: Mapping[str, str],
    layout: SequenceLayout,
) -> dict[str, str]:
    """Parameter name (as ``graph_module`` reads it) -> the node that gives it a partial
    gradient, for every parameter outside the split modules and the sequence-parallel norms
    that an op applies to one TP rank's share of the data (see the module docstring).
    ``planned``: module path -> TP style (:func:`.mesh.planned_modules`); ``layout``: the
    graph's :func:`.sequence_parallel.sequence_layout`, whose ``gradient_sums`` this fills.
    :class:`SequenceParallelError` for a parameter used both on a rank's share and on
    replicated values."""
    graph = graph_module.graph
    parameters = {name for name, _ in graph_module.named_parameters(remove_duplicate=False)}
    gets = {n: str(n.target) for n in graph.nodes if n.op == "get_attr"}
    norm_out = {out: norm for norm, out in layout.norms.items()}
    distinct: set[fx.Node] = set()  # the value its consumers see differs per TP rank
    influence: dict[fx.Node, set[str]] = {}  # parameters the value is computed from by plain ops
    partial: dict[str, str] = {}
    whole: dict[str, str] = {}
    for node in graph.nodes:
        path = planned_path(node, planned, gets)
        if node.op == "get_attr":
            # A parameter split with the heads it is applied to (layout.per_head): each
            # rank's rows meet only its own heads, so their gradient is whole.
            if gets[node] in parameters and gets[node] not in layout.per_head:
                influence[node] = {gets[node]}
            continue
        if node.op in ("placeholder", "output"):
            if node.op == "output":
                for a in node.all_input_nodes:
                    for p in influence.get(a, ()):
                        whole.setdefault(p, "the model's output")
            continue
        if path:
            style = planned[path]
            if style in _LOCAL_OUTPUT or style in ROWWISE_STYLES:
                distinct.add(node)
            # Its input's gradient comes back through the style's own redistribution: whole
            # for a replicated input, one rank's share for a distinct one.
            for a in node.all_input_nodes:
                if a not in distinct:
                    for p in influence.get(a, ()):
                        whole.setdefault(p, path)
            continue
        if node.name in norm_out:
            if norm_out[node.name] in layout.kept_sharded:
                distinct.add(node)
            continue
        if any(_in_module(node, norm) for norm in layout.norms):
            # A norm's own ops: torch's SequenceParallel owns its parameters; an alias of
            # its input that code after it reads is that input.
            if any(a in distinct for a in node.all_input_nodes):
                distinct.add(node)
            influence[node] = set().union(*(influence.get(a, set()) for a in node.all_input_nodes))
            continue
        if _is_shape_read(node) or node.target is operator.getitem and _reads_sizes(node):
            continue
        # A shard gathered for this op (SequenceLayout.gathers) is whole here; the gather's
        # backward keeps this rank's share of a gradient it takes to be whole, so what is
        # computed from it must come back whole too (tracked as a parameter would be).
        gathered = layout.gathers.get(node.name, {})
        out_distinct = any(a in distinct and a.name not in gathered for a in node.all_input_nodes)
        # A whole value computed from a gathered one that meets this rank's share here
        # (DeepSeek-V3's shared rotary key, copied into each rank's heads) gets back one
        # rank's part of its gradient: it is summed over the TP group on the way back
        # (SequenceLayout.gradient_sums), so what it was computed from gets it whole.
        summed = [
            a
            for a in node.all_input_nodes
            if out_distinct
            and a not in distinct
            and a.op != "get_attr"
            and any(p.startswith(_GATHERED) for p in influence.get(a, ()))
        ]
        if summed:
            layout.gradient_sums[node.name] = [a.name for a in summed]
        reads = set(_module_parameters(graph_module, node))
        for a in node.all_input_nodes:
            if a not in summed:
                reads |= influence.get(a, set())
        reads |= {f"{_GATHERED}{value}" for value in gathered}
        if out_distinct:
            distinct.add(node)
            for p in reads:
                partial.setdefault(p, node.name)
        if node.name in layout.transitions:
            # Sharded right after it (torch's PrepareModuleOutput, whose backward gathers the
            # gradient): what the op computed is replicated and its gradient comes back whole.
            for p in reads:
                whole.setdefault(p, f"the sequence shard of {node.name}")
            distinct.add(node)
            continue
        influence[node] = reads
    shares = sorted(p for p in partial if p.startswith(_GATHERED))
    if shares:
        value = shares[0][len(_GATHERED) :]
        raise SequenceParallelError(
            f"{value} is gathered over the sequence for ops whose result then meets one TP "
            f"rank's share of the data ({partial[shares[0]]}), so its gradient would be "
            "one rank's part of the whole; re-plan with --tensor-parallel 1"
        )
    both = sorted(set(partial) & set(whole))
    if both:
        p = both[0]
        raise SequenceParallelError(
            f"parameter {p} is applied both to one TP rank's share of the data ({partial[p]}) "
            f"and to values every rank holds whole ({whole[p]}), so no sum over the TP group "
            "makes its gradient right; re-plan with --tensor-parallel 1"
        )
    return partial


def tp_summed_parameters(body: nn.Module, partial: Mapping[str, str]) -> list[str]:
    """The names of ``partial`` (:func:`partial_gradient_parameters`) that are parameters of
    ``body`` (a stage graph, after torch's TP styles are applied) and that no style made a
    DTensor on the TP mesh (a DTensor's backward reduces its gradient itself)."""
    out = []
    for name, p in body.named_parameters():
        if name in partial and not isinstance(p, DTensor):
            out.append(name)
    return out


def _reads_sizes(node: fx.Node) -> bool:
    """Whether ``node`` picks an item of a shape (a ``getitem`` of a ``size()``)."""
    source = node.args[0] if node.args else None
    return isinstance(source, fx.Node) and _is_shape_read(source)
