"""Sequence parallelism on a tensor-parallel stage graph (Megatron-LM's, as torchtitan runs it).

With TP degree T, the values *between* the TP regions (the residual stream, the norms, the
dropouts: everything a row-wise linear's output reaches before the next column-wise one) are
held sharded over the sequence dimension (dim 1, ``[b, s / T, h]`` per rank) instead of whole
on every rank. A row-wise linear then ends its region with a reduce-scatter (torch's
``RowwiseParallel(output_layouts=Shard(1))``) instead of an all-reduce, and the next region
starts with an all-gather. This module decides, from the traced graph alone, which values
are sharded and which modules run sharded; :mod:`.mesh` applies torch's styles.

What is read from the graph (no module names are assumed):

- **Norms** (``SequenceParallel``): the module that computes the input of a column-wise
  planned linear (looking back through no-op views: a whole-range slice, a cast to the
  same dtype), when it holds no split module and its ops read one tensor (a Llama's
  ``input_layernorm``, a GPT's ``ln_1``, the final norm before the LM head, OLMo's
  weightless LayerNorm, Cohere's one norm before attention and MLP). Its forward runs
  on a sequence shard, so it must treat positions independently: that is checked by running
  it on a random input whole and in two halves. Its output is gathered once (torch's
  ``PrepareModuleOutput``, Shard(1) -> Replicate, kept a DTensor) for all the column-wise
  linears it feeds, which is the one all-gather per region the cost model prices; it keeps
  reading the global shape (``x.shape`` in a model's forward is the whole sequence's).
- **Sharded values**: the outputs of row-wise (and vocab-parallel embedding) modules and of
  every position-wise op (pointwise ops, dtype casts, dropout, parameter-free activation
  modules) that reads a sharded value before the next column-wise linear; a shape read of
  a shard is refused in one line.
- **Norms on the shard** (``SequenceParallel``, output kept a local shard): a module that
  reads a sharded value, returns one of its shape, holds no split module and no parameter
  of more than one dimension, and is position-wise when run whole and in two halves:
  OLMo-2's post norms, GLM-4's and Gemma's sandwich norms, the norm before a
  mixture-of-experts block.
- **Token modules** (:attr:`SequenceLayout.token_modules`): a module, otherwise alike, whose
  ops are not position-wise one by one but that is as a whole (a mixture-of-experts block
  routes each token on its own): called as a module on each rank's share of the tokens,
  its parameters plain, their gradients summed over TP (:mod:`.tp_gradients`).
- **Gathers** (:attr:`SequenceLayout.gathers`): any other op that reads a shard needs the
  whole sequence (DeepSeek-V3's MLA low-rank projections, an attention): it reads the
  value gathered (``PrepareModuleOutput``, Shard -> Replicate, on an ``nn.Identity``
  before it) and runs whole on every rank. Where what it computes then meets one rank's
  share of the heads (MLA's shared rotary key), the gradient is summed over TP there
  (:attr:`SequenceLayout.gradient_sums`, ``mesh.TPGradientSum``).
- **Transitions**: a replicated value that a norm or a sharded op reads with the sequence
  along one of its dimensions (the embedding's output; a GPT's position embeddings) is
  sharded where it is produced (torch's ``PrepareModuleOutput``, Replicate -> Shard, on an
  ``nn.Identity`` inserted after it; its backward all-gathers the gradient).

fx graphs call leaf modules (``nn.LayerNorm``) as modules already; torch.export graphs have
inlined every module into aten ops, so a norm is found by the ``nn_module_stack`` its ops
carry, and :func:`call_norm_modules` replaces those ops by one call of the module (so that
its forward, where the style hooks in, runs).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autopipe.core.errors import UsageError
from autopipe.core.vocabulary import SEQUENCE_DIM  # [batch, seq, hidden]: Shard(1)

__all__ = [
    "SequenceLayout",
    "SequenceParallelError",
    "adopt_norms",
    "call_norm_modules",
    "insert_gathers",
    "insert_gradient_sums",
    "insert_transitions",
    "module_path_of",
    "sequence_layout",
]


COLWISE_STYLES = ("colwise", "colwise_rep", "colwise_gather_output")
"""Styles that start a TP region (their input is gathered whole)."""
ROWWISE_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise")
"""Styles that end one (their output is reduce-scattered over the sequence)."""

_LINEAR_FUNCTIONS = {torch.ops.aten.linear.default, torch.nn.functional.linear}
_EMBEDDING_FUNCTIONS = {torch.ops.aten.embedding.default, torch.nn.functional.embedding}
_SHAPE_READS = {"shape", "size", "dim", "ndim", "dtype", "device"}
_POSITION_WISE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div,
    torch.nn.functional.dropout, torch.nn.functional.gelu, torch.nn.functional.silu,
    torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.dropout.default,
    torch.ops.aten.native_dropout.default, torch.ops.aten.clone.default,
    torch.ops.aten.alias.default, torch.ops.aten._to_copy.default,
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
}  # fmt: skip
_POSITION_WISE_METHODS = {
    "add", "sub", "mul", "div", "contiguous", "to", "float", "half", "bfloat16", "type_as",
    "clone",
}  # fmt: skip


class SequenceParallelError(UsageError, ValueError):
    """A TP stage graph that sequence parallelism cannot shard (one line: what, and how to
    re-plan)."""


@dataclass
class SequenceLayout:
    """Which values of a traced model run sharded over the sequence on a TP mesh."""

    degree: int
    """T: the TP degree (each rank holds ``sequence_length / T`` positions)."""
    sequence_length: int
    norms: dict[str, str] = field(default_factory=dict)
    """Norm module path -> the graph node holding its output (SequenceParallel)."""
    sharded: dict[str, int] = field(default_factory=dict)
    """Value (node name) -> its sequence dimension, for every value its consumers (and a
    pipeline cut) see sharded: a cut's tensor is ``1 / T`` of the unsharded one."""
    transitions: dict[str, int] = field(default_factory=dict)
    """Replicated value -> the dimension it is sharded along right where it is produced."""
    kept_sharded: set[str] = field(default_factory=set)
    """Norms whose output is read by more than split modules (a post-norm block's residual):
    it stays a local shard, and each column-wise module it feeds gathers it itself."""
    gathered: set[str] = field(default_factory=set)
    """No-op views (a whole-range slice, a cast to the same dtype) between a norm and the
    split modules it feeds: they see the norm's gathered DTensor."""
    colwise_inputs: dict[str, str] = field(default_factory=dict)
    """Column-wise module path -> ``"norm"`` (a gathered DTensor from a norm), ``"sharded"``
    (a local sequence shard: the module gathers it) or ``"replicated"``."""
    gathers: dict[str, dict[str, int]] = field(default_factory=dict)
    """Op (node name) that needs the whole sequence of a sharded value it reads (a view to
    ``[b * s, h]``, a mixture-of-experts router, a linear no TP plan splits) -> each such
    value and its sequence dim: the op reads it gathered (torch's ``PrepareModuleOutput``,
    Shard -> Replicate, on an ``nn.Identity`` before it) and its output is replicated."""
    token_modules: dict[str, str] = field(default_factory=dict)
    """Module path -> the node holding its output, for each module that runs on the shard
    as it is (its own forward on ``[b, s / T, h]``, its parameters plain, their gradients
    summed over the TP group: :mod:`.tp_gradients`) though its ops are not position-wise
    one by one: a mixture-of-experts block, which routes and computes each token on its
    own (checked by running it whole and in two halves), so each rank routes its own share
    of the tokens, as the cost model prices it."""
    gradient_sums: dict[str, list[str]] = field(default_factory=dict)
    """Op -> the whole values computed from a gathered one that it applies to this TP rank's
    share of the data: their gradient is summed over the TP group on the way back (filled
    by :func:`.tp_gradients.partial_gradient_parameters`)."""
    per_head: dict[str, str] = field(default_factory=dict)
    """Parameter -> the column-wise projection it is applied per head of (Cohere's q/k norm
    weight ``[heads, head_dim]``): split with the heads, ``Shard(0)`` over the TP mesh
    (:func:`.mesh.per_head_parameters`), so each rank's gradient of its rows is whole."""

    def local_shape(self, name: str, shape: Iterable[int]) -> list[int]:
        """The shape one TP rank holds of value ``name`` whose unsharded shape is ``shape``."""
        out = list(shape)
        dim = self.sharded.get(name)
        if dim is not None:
            out[dim] //= self.degree
        return out


def module_path_of(node: fx.Node) -> str:
    """The innermost module ``node`` runs in: a ``call_module``'s target, else the last entry
    of torch.export's ``nn_module_stack`` ("" at the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def _in_module(node: fx.Node, path: str) -> bool:
    if node.op == "call_module":
        return node.target == path
    stack = node.meta.get("nn_module_stack") or {}
    return any(str(v[0]) == path for v in stack.values())


def planned_path(node: fx.Node, planned: Mapping[str, str], gets: Mapping[fx.Node, str]) -> str:
    """The planned module ``node`` calls ("" for none): a ``call_module`` of it, or an
    ``aten.linear`` / ``aten.embedding`` on its weight."""
    if node.op == "call_module":
        return str(node.target) if node.target in planned else ""
    if node.op != "call_function":
        return ""
    if node.target in _LINEAR_FUNCTIONS and len(node.args) > 1:
        weight = node.args[1]
    elif node.target in _EMBEDDING_FUNCTIONS and node.args:
        weight = node.args[0]
    else:
        return ""
    target = gets.get(weight) if isinstance(weight, fx.Node) else None
    if target and target.endswith(".weight") and target[: -len(".weight")] in planned:
        return target[: -len(".weight")]
    return ""


def _region(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The ops run in module ``path``, but for sizes (a module called as a module computes
    its own; torch.export's symbolic batch size stays for the code after it)."""
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")
            and _in_module(n, path) and not _is_size(n)]  # fmt: skip


def _is_size(node: fx.Node) -> bool:
    """Whether ``node`` computes a size (an int or a symbolic one), not a tensor."""
    value = node.meta.get("val")
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


_CASTS = {
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.alias.default,
}  # fmt: skip


def _is_alias_of(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` is a cast of ``source`` to its own dtype (an alias: torch.export
    lets the code after a module read the module's no-op cast of its input)."""
    if node.op != "call_function" or node.target not in _CASTS or node.args[0] is not source:
        return False
    have, want = node.meta.get("val"), source.meta.get("val")
    return (
        isinstance(have, torch.Tensor)
        and isinstance(want, torch.Tensor)
        and (have.dtype == want.dtype and have.shape == want.shape)
    )


def _region_io(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The tensors a module's ops read from outside (its own parameters' ``get_attr`` aside)
    and its ops whose values are used outside (aliases of the one tensor read aside)."""
    inside = set(nodes)
    reads: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr" and a not in reads and not _is_size(a):
                reads.append(a)
    used = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(reads) == 1:
        used = [n for n in used if not _is_alias_of(n, reads[0])]
    return reads, used


def _is_position_wise_module(module: nn.Module, hidden: int, length: int) -> bool:
    """Whether ``module`` treats the positions of a ``[2, length, hidden]`` input
    independently: its output on the whole equals its outputs on two halves joined."""
    if length < 2:
        return True
    g = torch.Generator().manual_seed(0)
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "meta":
        return True  # nothing to run; the equality tests hold the rule for real weights
    x = torch.randn(2, length, hidden, generator=g).to(device=device, dtype=dtype)
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            whole = module(x)
            half = length // 2
            # Each rank holds its shard as a tensor of its own (contiguous), not a view.
            halves = [module(x[:, :half].contiguous()), module(x[:, half:].contiguous())]
            parts = torch.cat(halves, dim=1)
    except Exception:
        return False
    finally:
        module.train(was)
    return isinstance(whole, torch.Tensor) and torch.allclose(whole, parts, rtol=1e-5, atol=1e-6)


def _position_wise(node: fx.Node, graph_module: fx.GraphModule) -> bool:
    if node.op == "call_function":
        target = node.target
        if target in _POSITION_WISE_FUNCTIONS or target is operator.getitem:
            return True
        tags = getattr(target, "tags", ())
        return torch.Tag.pointwise in tags
    if node.op == "call_method":
        return node.target in _POSITION_WISE_METHODS
    if node.op == "call_module":
        module = graph_module.get_submodule(str(node.target))
        kinds = ("torch.nn.modules.dropout", "torch.nn.modules.activation")
        return type(module).__module__ in kinds or isinstance(module, nn.Identity)
    return False


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return tuple(int(d) for d in value[0].shape)
    return None


def _is_transparent(node: fx.Node, values: Mapping[str, Any]) -> bool:
    """Whether ``node`` is a no-op view of its first argument (same shape and dtype): a
    slice over a whole dimension (Hugging Face's ``logits_to_keep`` slice before the head),
    a cast to its own dtype, an alias."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target not in _CASTS | {torch.ops.aten.slice.Tensor, operator.getitem}:
        return False
    have, want = values.get(node.name), values.get(node.args[0].name)
    return (
        isinstance(have, torch.Tensor)
        and isinstance(want, torch.Tensor)
        and have.shape == want.shape
        and have.dtype == want.dtype
    )


def _is_shape_read(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in _SHAPE_READS
    if node.op == "call_method":
        return node.target in ("size", "dim")
    return node.op == "call_function" and node.target in (
        torch.ops.aten.sym_size.int,
        torch.ops.aten._assert_tensor_metadata.default,
    )


def sequence_layout(
    graph_module: fx.GraphModule,
    model: nn.Module,
    planned: Mapping[str, str],
    values: Mapping[str, Any],
    degree: int,
) -> SequenceLayout:
    """The sequence-parallel layout of the whole traced model ``graph_module`` (the graph the
    stages are cut from) whose modules ``planned`` (path -> TP style) are split T =
    ``degree`` ways; ``values``: every node's value on one micro-batch (fake tensors do).
    :class:`SequenceParallelError` where the graph cannot run sharded. O(nodes x passes);
    a pass per new transition, a handful in a transformer."""
    graph = graph_module.graph
    gets = {n: str(n.target) for n in graph.nodes if n.op == "get_attr"}
    calls = {n: planned_path(n, planned, gets) for n in graph.nodes}
    calls = {n: p for n, p in calls.items() if p}
    length = _sequence_length(calls, planned, values, degree)
    layout = SequenceLayout(degree=degree, sequence_length=length)
    region_of, norm_input, views = _find_norms(layout, graph, model, calls, planned, values)
    by_name = {n.name: n for n in graph.nodes}
    for norm, out in layout.norms.items():
        if _feeds_split_modules_only(by_name[out], calls, planned, views[norm]):
            layout.gathered |= views[norm]
        else:
            layout.kept_sharded.add(norm)
    for _ in range(2 * len(graph.nodes) + 1):
        sharded, gathers, whole = _propagate(graph_module, layout, calls, planned, region_of)
        if _adopt_sharded_norms(layout, graph, model, whole, planned, values, sharded,
                                region_of, norm_input):  # fmt: skip
            continue  # a norm on the shard (a sandwich or post norm): propagate again
        if _adopt_token_modules(layout, graph, model, whole, planned, values, sharded, region_of):
            continue  # a mixture of experts on the shard: propagate again
        new = _needed_transitions(graph, layout, sharded, norm_input, calls, values)
        if not new:
            break
        layout.transitions.update(new)
    layout.sharded = sharded
    layout.gathers = gathers
    for node, path in calls.items():
        if planned[path] in COLWISE_STYLES:
            x = node.args[0]
            layout.colwise_inputs[path] = (
                "sharded"
                if isinstance(x, fx.Node) and x.name in sharded
                else "norm"
                if isinstance(x, fx.Node)
                and (region_of.get(x) is not None or x.name in layout.gathered)
                else "replicated"
            )
    return layout


def _sequence_length(
    calls: Mapping[fx.Node, str],
    planned: Mapping[str, str],
    values: Mapping[str, Any],
    degree: int,
) -> int:
    """The one sequence length of the row-wise split modules' ``[batch, seq, ...]`` outputs;
    SequenceParallelError unless there is exactly one and ``degree`` divides it."""
    lengths = {
        shape[SEQUENCE_DIM]
        for n, p in calls.items()
        if planned[p] in ROWWISE_STYLES
        for shape in [_shape(values.get(n.name))]
        if shape is not None and len(shape) > SEQUENCE_DIM
    }
    if len(lengths) != 1:
        raise SequenceParallelError(
            "sequence parallelism needs the row-wise split modules' outputs to be [batch, "
            f"seq, ...] with one sequence length (found {sorted(lengths)}); re-plan with "
            "--tensor-parallel 1"
        )
    (length,) = lengths
    if length % degree:
        raise SequenceParallelError(
            f"the sequence length {length} is not divisible by tensor-parallel degree "
            f"{degree}, which sequence parallelism splits it by; use a sequence length "
            "that T divides or re-plan with another --tensor-parallel"
        )
    return length


def _find_norms(
    layout: SequenceLayout,
    graph: fx.Graph,
    model: nn.Module,
    calls: Mapping[fx.Node, str],
    planned: Mapping[str, str],
    values: Mapping[str, Any],
) -> tuple[dict[fx.Node, str], dict[str, fx.Node], dict[str, set[str]]]:
    """Record in ``layout.norms`` each position-wise module that feeds a column-wise split
    module; returns each of their nodes' norm, each norm's input read, and the nodes
    (views) between each norm and the split modules. SequenceParallelError for a module
    there that mixes sequence positions."""
    length = layout.sequence_length
    region_of: dict[fx.Node, str] = {}
    norm_input: dict[str, fx.Node] = {}
    views: dict[str, set[str]] = {}
    for node, path in calls.items():
        if planned[path] not in COLWISE_STYLES:
            continue
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node):
            continue
        found = _norm_feeding(first, graph, model, planned, values)
        if found is None:
            continue
        norm, module, x, chain, nodes, reads = found
        views.setdefault(norm, set()).update(n.name for n in chain)
        if norm in layout.norms:
            continue
        shape = _shape(values.get(x.name))
        assert shape is not None  # _norm_feeding checked
        # A few positions tell (a [2, 8192, 16384] float input would be 1 GiB per rank).
        if not _is_position_wise_module(module, shape[-1], min(length, 8)):
            raise SequenceParallelError(
                f"{norm} ({type(module).__name__}) feeds the split {path} but does not treat "
                "sequence positions independently, so sequence parallelism cannot shard it; "
                "re-plan with --tensor-parallel 1"
            )
        layout.norms[norm] = x.name
        norm_input[norm] = reads[0]
        for n in nodes:
            region_of[n] = norm
    return region_of, norm_input, views


def _norm_feeding(
    first: fx.Node,
    graph: fx.Graph,
    model: nn.Module,
    planned: Mapping[str, str],
    values: Mapping[str, Any],
) -> tuple[str, nn.Module, fx.Node, list[fx.Node], list[fx.Node], list[fx.Node]] | None:
    """The module computing ``first`` (a column-wise module's input), looking back through
    no-op views: (its path, the module, the node holding its output, the views between,
    its ops, the one tensor it reads); None when there is none that a split could run
    sharded (the root, a module holding split ones, ops reading more than one tensor or
    used outside but for that output, or an output shaped unlike the input)."""
    candidates = [first]
    while _is_transparent(candidates[-1], values):
        candidates.append(candidates[-1].args[0])  # type: ignore[arg-type]  # a Node
    for k, x in enumerate(candidates):
        norm = module_path_of(x)
        if not norm or any(p == norm or p.startswith(norm + ".") for p in planned):
            continue
        try:
            module = model.get_submodule(norm)
        except AttributeError:
            continue
        nodes = [x] if x.op == "call_module" else _region(graph, norm)
        reads, used = _region_io(nodes)
        shape = _shape(values.get(x.name))
        # A norm maps activations to activations of the same shape (an embedding does not).
        if len(reads) == 1 and used == [x] and shape and shape == _shape(values.get(reads[0].name)):
            return norm, module, x, candidates[:k], nodes, reads
    return None


def _feeds_split_modules_only(
    node: fx.Node, calls: Mapping[fx.Node, str], planned: Mapping[str, str], views: set[str]
) -> bool:
    """Whether every reader of ``node`` (through the no-op ``views``) is a column-wise split
    module or a shape read."""
    for user in node.users:
        if user.name in views:
            if not _feeds_split_modules_only(user, calls, planned, views):
                return False
        elif not (
            (user in calls and planned[calls[user]] in COLWISE_STYLES) or _is_shape_read(user)
        ):
            return False
    return True


def _shard_region(
    graph: fx.Graph,
    node: fx.Node,
    path: str,
    module: nn.Module,
    values: Mapping[str, Any],
    sharded: Mapping[str, int],
    layout: SequenceLayout,
) -> tuple[list[fx.Node], fx.Node, fx.Node] | None:
    """(its ops, the one value it reads, its one op used outside) when module ``path``
    around ``node`` can run on the shard as it is: it reads one sequence-sharded tensor,
    returns one of that shape, and is position-wise when run (whole against two halves);
    None otherwise. Shared by the norms kept sharded and the token modules."""
    nodes = [node] if node.op == "call_module" else _region(graph, path)
    reads, used = _region_io(nodes)
    if len(reads) != 1 or len(used) != 1 or reads[0].name not in sharded:
        return None
    shape = _shape(values.get(used[0].name))
    if not shape or shape != _shape(values.get(reads[0].name)):
        return None
    if not _is_position_wise_module(module, shape[-1], min(layout.sequence_length, 8)):
        return None
    return nodes, reads[0], used[0]


def _adopt_sharded_norms(
    layout: SequenceLayout,
    graph: fx.Graph,
    model: nn.Module,
    whole: list[fx.Node],
    planned: Mapping[str, str],
    values: Mapping[str, Any],
    sharded: Mapping[str, int],
    region_of: dict[fx.Node, str],
    norm_input: dict[str, fx.Node],
) -> bool:
    """Record as a norm that keeps its output a shard (``layout.kept_sharded``) each module
    around an op of ``whole`` (ops that read a shard but are not position-wise) that is a
    norm reading a sharded value: one tensor in, one of its shape out, no parameter of more
    than one dimension (a norm scales features; a mixture of experts or a linear holds
    matrices and is gathered for instead), no split module inside, and position-wise when
    run (whole against two halves). A Gemma-2 / GLM-4 sandwich norm, OLMo-2's post norms,
    the norm before a mixture-of-experts router. Whether any was added."""
    added = False
    for node in whole:
        for norm in _enclosing_modules(node):
            if norm in layout.norms or any(p == norm or p.startswith(norm + ".") for p in planned):
                continue
            try:
                module = model.get_submodule(norm)
            except AttributeError:
                continue
            if any(p.dim() > 1 for p in module.parameters()):
                continue
            found = _shard_region(graph, node, norm, module, values, sharded, layout)
            if found is None:
                continue
            nodes, read, used = found
            layout.norms[norm] = used.name
            layout.kept_sharded.add(norm)
            norm_input[norm] = read
            for n in nodes:
                region_of[n] = norm
            added = True
            break
    return added


def _adopt_token_modules(
    layout: SequenceLayout,
    graph: fx.Graph,
    model: nn.Module,
    whole: list[fx.Node],
    planned: Mapping[str, str],
    values: Mapping[str, Any],
    sharded: Mapping[str, int],
    region_of: dict[fx.Node, str],
) -> bool:
    """Record in ``layout.token_modules`` the innermost module around the first op of
    ``whole`` that can run on the shard as it is: one sharded tensor in, one of its shape
    out, no split module inside, and position-wise when run (whole against two halves).
    Whether one was added."""
    for node in whole:
        for path in _enclosing_modules(node):
            if path in layout.norms or path in layout.token_modules:
                continue
            if any(p == path or p.startswith(path + ".") for p in planned):
                break  # an outer module holds split ones too
            module = model.get_submodule(path)
            found = _shard_region(graph, node, path, module, values, sharded, layout)
            if found is None:
                continue
            nodes, _, used = found
            layout.token_modules[path] = used.name
            for n in nodes:
                region_of[n] = path
            return True
    return False


def _enclosing_modules(node: fx.Node) -> list[str]:
    """The module paths ``node`` runs in, innermost first (a ``call_module``'s own target)."""
    if node.op == "call_module":
        return [str(node.target)]
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) for v in reversed(list(stack.values())) if v[0]]


def _propagate(
    graph_module: fx.GraphModule,
    layout: SequenceLayout,
    calls: Mapping[fx.Node, str],
    planned: Mapping[str, str],
    region_of: Mapping[fx.Node, str],
) -> tuple[dict[str, int], dict[str, dict[str, int]], list[fx.Node]]:
    """Value -> sequence dim of every value its consumers see sharded, given the
    transitions and norms so far; the ops that read a shard gathered (op -> value -> dim)
    as they are not position-wise, and those ops. :class:`SequenceParallelError` for a
    sharded value read by what cannot read a shard nor gather it."""
    sharded: dict[str, int] = {}
    gathers: dict[str, dict[str, int]] = {}
    whole: list[fx.Node] = []
    kept = {layout.norms[n] for n in layout.kept_sharded}
    norm_outputs = (set(layout.norms.values()) - kept) | layout.gathered
    kept |= set(layout.token_modules.values())
    for node in graph_module.graph.nodes:
        if node.name in layout.gathered:
            pass  # a no-op view of a norm's gathered output, on its way to a split module
        elif node in calls:
            if planned[calls[node]] in ROWWISE_STYLES:
                sharded[node.name] = SEQUENCE_DIM
        elif node in region_of:
            # A norm's own ops run inside the module on the shard it is given; a no-op cast
            # of its input that code after it reads is that input (call_norm_modules).
            source = node.args[0] if node.args else None
            if node.name in kept:  # a norm whose output stays a shard
                sharded[node.name] = SEQUENCE_DIM
            elif isinstance(source, fx.Node) and source.name in sharded:
                if _is_alias_of(node, source):
                    sharded[node.name] = sharded[source.name]
        elif node.op == "output":
            leaked = [a.name for a in node.all_input_nodes if a.name in sharded]
            if leaked:
                raise SequenceParallelError(
                    f"the model's output {leaked[0]} would be sharded over the sequence (no "
                    "column-wise split module gathers it); re-plan with --tensor-parallel 1"
                )
        elif node.op in ("call_function", "call_method", "call_module"):
            if not _propagate_op(node, graph_module, sharded, norm_outputs):
                whole.append(node)
                gathers[node.name] = {
                    a.name: sharded[a.name] for a in node.all_input_nodes if a.name in sharded
                }
        if node.name in layout.transitions:
            sharded[node.name] = layout.transitions[node.name]
    return sharded, gathers, whole


def _propagate_op(
    node: fx.Node, graph_module: fx.GraphModule, sharded: dict[str, int], norm_outputs: set[str]
) -> bool:
    """An op outside the split modules and norms: its output is sharded when it reads a
    shard position-wise; False when it reads a shard but is not position-wise (it needs the
    whole sequence: its sharded inputs are gathered for it); SequenceParallelError when it
    reads a gathered norm output or a shard's shape."""
    inputs = node.all_input_nodes
    reads_norm = [a for a in inputs if a.name in norm_outputs]
    if reads_norm and not _is_shape_read(node):
        raise SequenceParallelError(
            f"{node.name} reads the norm output {reads_norm[0].name}, which is "
            "gathered for the split modules only; re-plan with --tensor-parallel 1"
        )
    if not any(a.name in sharded for a in inputs):
        return True
    if _is_shape_read(node):
        if node.target is not torch.ops.aten._assert_tensor_metadata.default:
            raise SequenceParallelError(
                f"{node.name} reads the shape of a sequence-sharded value "
                f"({module_path_of(node) or 'the model'}); re-plan with "
                "--tensor-parallel 1"
            )
    elif not _position_wise(node, graph_module):
        return False
    else:
        sharded[node.name] = SEQUENCE_DIM
    return True


def _needed_transitions(
    graph: fx.Graph,
    layout: SequenceLayout,
    sharded: Mapping[str, int],
    norm_input: Mapping[str, fx.Node],
    calls: Mapping[fx.Node, str],
    values: Mapping[str, Any],
) -> dict[str, int]:
    """Replicated values that a norm or a sharded op (not a split module) reads along the
    sequence."""
    new: dict[str, int] = {}
    for x in norm_input.values():
        if x.name not in sharded:
            new[x.name] = SEQUENCE_DIM
    for node in graph.nodes:
        if node.name not in sharded or node.name in layout.transitions or node in calls:
            continue
        out = _shape(values.get(node.name))
        if out is None:
            continue
        for a in node.all_input_nodes:
            while a.args and isinstance(a.args[0], fx.Node) and _is_alias_of(a, a.args[0]):
                a = a.args[0]  # shard the value itself, not a no-op cast of it
            if a.name in sharded or a.op == "get_attr":
                continue
            shape = _shape(values.get(a.name))
            if shape is None:
                continue
            dim = SEQUENCE_DIM - (len(out) - len(shape))  # broadcasting aligns from the right
            if 0 <= dim < len(shape) and shape[dim] == layout.sequence_length > 1:
                new[a.name] = dim
    return {k: v for k, v in new.items() if k not in layout.transitions}


def adopt_norms(body: fx.GraphModule, model: nn.Module, norms: Mapping[str, str]) -> None:
    """Put ``model``'s own module at the path of each norm of ``norms`` (path -> output
    node name) that the stage graph ``body`` computes, so that it can be called (a traced
    graph holds at most its parameters there)."""
    names = {n.name for n in body.graph.nodes if n.op != "placeholder"}
    for path, out_name in norms.items():
        if out_name in names:
            body.add_submodule(path, model.get_submodule(path))


def call_norm_modules(body: fx.GraphModule, norms: Mapping[str, str]) -> list[str]:
    """Rewrite ``body`` (in place) so that each norm of ``norms`` (path -> output node name)
    it computes is one ``call_module`` of the norm (a torch.export graph inlines it into
    aten ops; an fx graph calls it already); the paths it holds."""
    graph = body.graph
    by_name = {n.name: n for n in graph.nodes}
    held = []
    for path, out_name in norms.items():
        out = by_name.get(out_name)
        if out is None or out.op == "placeholder":
            continue
        held.append(path)
        if out.op == "call_module":
            continue
        nodes = _region(graph, path)
        reads, used = _region_io(nodes)
        assert len(reads) == 1 and used == [out], path  # sequence_layout checked it
        inside = set(nodes)

        def outside(user: fx.Node, inside: set[fx.Node] = inside) -> bool:
            return user not in inside

        for n in nodes:
            if n is not out and _is_alias_of(n, reads[0]):
                n.replace_all_uses_with(reads[0], delete_user_cb=outside)
        with graph.inserting_before(out):
            call = graph.call_module(path, (reads[0],))
        call.meta = dict(out.meta)
        out.replace_all_uses_with(call)
        for n in reversed(nodes):
            graph.erase_node(n)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    graph.lint()
    body.recompile()
    return held


def insert_transitions(body: fx.GraphModule, transitions: Mapping[str, int]) -> dict[str, int]:
    """After each value of ``transitions`` that ``body`` produces, a call of a new
    ``nn.Identity`` submodule that every former use reads instead (the style that shards
    the value hooks onto it); its submodule path -> the dimension to shard."""
    graph = body.graph
    added: dict[str, int] = {}
    for node in list(graph.nodes):
        if node.name not in transitions or node.op in ("placeholder", "output"):
            continue
        path = f"sequence_shard_{node.name}"
        body.add_submodule(path, nn.Identity())
        with graph.inserting_after(node):
            call = graph.call_module(path, (node,))
        node.replace_all_uses_with(call, delete_user_cb=lambda user, c=call: user is not c)
        added[path] = transitions[node.name]
    graph.lint()
    body.recompile()
    return added


def insert_gathers(
    body: fx.GraphModule, gathers: Mapping[str, Mapping[str, int]]
) -> dict[str, int]:
    """Before the first op of ``body`` that ``gathers`` (op -> sharded value -> its sequence
    dim, :attr:`SequenceLayout.gathers`) names for a value, a call of a new ``nn.Identity``
    submodule on the value that those ops read instead (the style that gathers it hooks
    onto it; positions-wise readers keep the shard); its submodule path -> the dimension
    the value is sharded along."""
    graph = body.graph
    readers: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        for value in gathers.get(node.name, {}):
            readers.setdefault(value, []).append(node)
    added: dict[str, int] = {}
    for value, ops in readers.items():
        dim = gathers[ops[0].name][value]
        source = next(a for a in ops[0].all_input_nodes if a.name == value)
        path = f"sequence_gather_{value}"
        body.add_submodule(path, nn.Identity())
        with graph.inserting_before(ops[0]):
            call = graph.call_module(path, (source,))
        for op in ops:
            op.replace_input_with(source, call)
        added[path] = dim
    graph.lint()
    body.recompile()
    return added


def insert_gradient_sums(
    body: fx.GraphModule, sums: Mapping[str, list[str]], make: Any
) -> list[str]:
    """Between each op of ``body`` that ``sums`` names (op -> values it reads,
    :attr:`SequenceLayout.gradient_sums`) and those values, a call of a new submodule
    ``make()`` (the identity forward, its backward summing the gradient over the TP group)
    that the op reads instead; the submodule paths."""
    graph = body.graph
    added: list[str] = []
    for node in list(graph.nodes):
        for value in sums.get(node.name, []):
            source = next(a for a in node.all_input_nodes if a.name == value)
            path = f"tp_gradient_sum_{value}_{node.name}"
            body.add_submodule(path, make())
            with graph.inserting_before(node):
                call = graph.call_module(path, (source,))
            node.replace_input_with(source, call)
            added.append(path)
    graph.lint()
    body.recompile()
    return added
