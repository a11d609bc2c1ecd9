"""A plan on a ``(pp, dp, tp)`` device mesh: tensor parallelism and sharded training state.

Plans with ``tensor_parallel`` (T) > 1 or ``shard`` other than ``none`` run on
``init_device_mesh(device, (K, D, T), mesh_dim_names=("pp", "dp", "tp"))`` (torchtitan's
layout: tp innermost, adjacent ranks; pp outermost; rank = pp * D * T + dp * T + tp). Each
rank's chunks are built as for a plain pipeline, then, with torch's own parts only:

1. **TP** (T > 1), Megatron-style with sequence parallelism: ``parallelize_module`` over
   ``mesh["tp"]`` with the plan's ``tp_plan`` (module path patterns from the model root,
   ``*`` matching one path part, as in Hugging Face's ``base_model_tp_plan``). Two
   things stand between a traced stage graph and torch's TP styles, both handled here:

   - torch.export writes every size it saw as a number (``view(x, [b, 8, 4, 8])``, the
     key/value heads repeated to ``4``), so a graph traced from the whole model would
     reshape one rank's share of the heads to the global head count. The stages of a TP
     plan are therefore traced a second time with every split module replaced by one of
     its local shape (:func:`local_shapes`; views of the real weights, nothing copied):
     the graph then holds one rank's sizes. The first trace, of the whole model, is what
     the ranks agree on and what the plan's parameter counts are checked against.
   - a torch.export graph reads a Linear's weight with ``get_attr`` and calls
     ``aten.linear`` on it, so the module's forward, where the TP style hooks its
     redistributions, never runs: such calls are turned back into calls of the module
     (:func:`call_planned_modules`). fx graphs call leaf modules already.

   Activations between the TP regions are sharded over the sequence (local tensors
   ``[b, s / T, h]``): row-wise modules reduce-scatter their output, the norms run
   ``SequenceParallel`` and gather their output once for the column-wise modules they feed
   (:mod:`.sequence_parallel` reads which values and modules from the graph). A
   vocab-parallel embedding (``embedding_rowwise``) is torch's ``RowwiseParallel`` on the
   ``nn.Embedding``.
2. **Sharding** over ``mesh["dp"]`` (:func:`apply_sharding`): ``parameters`` (ZeRO-3) is
   FSDP2's ``fully_shard`` of each chunk (one parameter group per chunk: a stage graph
   calls its units' modules inline, so per-unit groups would never gather);
   ``gradients`` is FSDP2 with ``reshard_after_forward=False`` (FSDP's ``SHARD_GRAD_OP``,
   what torch offers for ZeRO-2: gradients are reduce-scattered and the optimizer state
   is sharded; parameters are gathered once per step and kept until the backward, and
   held sharded between steps, which ZeRO-2 proper does not do; torch has no
   gradient-only sharding); ``optimizer`` (ZeRO-1) keeps the gradient all-reduce and
   shards the optimizer state with ``torch.distributed.optim.ZeroRedundancyOptimizer``
   over the dp group (:func:`make_zero_optimizer`; with TP over the DTensors' local
   tensors, :class:`LocalZeroOptimizer`).
3. ``PipelineStage`` over ``mesh["pp"]``; ``torch.distributed.pipelining`` defers FSDP's
   gradient reduction to the last micro-batch itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from autopipe.profiler.tensor_parallel import tied_split, tp_pattern
from autopipe.runtime.distributed.context_parallel import build_context_mesh, world_size_problem
from autopipe.runtime.distributed.sequence_parallel import (
    SequenceLayout,
    call_norm_modules,
    insert_gathers,
    insert_gradient_sums,
    insert_transitions,
)
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh

from autopipe.core.errors import UsageError
from autopipe.core.mesh_rules import (
    loss_parallel_problem,
    mesh_problems,
    mesh_schedule_problem,
    tied_chunks_problem,
)
from autopipe.core.plan import Plan
from autopipe.core.vocabulary import (
    MESH_DIM_NAMES,
    REPLICATED_TP_STYLES,
    SEQUENCE_DIM,
    TP_STYLES,
)

__all__ = [
    "MeshPlanError",
    "apply_sharding",
    "apply_tensor_parallel",
    "build_mesh",
    "call_planned_modules",
    "check_mesh_plan",
    "check_shard_dtypes",
    "expert_mesh",
    "expert_plan_problem",
    "local_shapes",
    "LocalZeroOptimizer",
    "make_zero_optimizer",
    "per_head_parameters",
    "planned_modules",
    "retie",
    "split_per_head",
    "tied_slots",
    "tp_style",
]


class MeshPlanError(UsageError, ValueError):
    """A mesh plan this runtime cannot run (one line saying what and how to fix it)."""


def expert_plan_problem(plan: Plan) -> str | None:
    """The one-line refusal of an expert-parallel plan (E > 1) this runtime does not run, or
    None: the EP group is E consecutive data-parallel ranks of a stage
    (:mod:`.expert_parallel`; of its dp x cp ranks with context parallelism), so E must
    divide D (D x C). With TP each expert's FFN is split over the TP ranks too (with or
    without CP); ZeRO-1 runs with EP (:class:`~.expert_parallel.ExpertZeroOptimizer`), with
    TP too (:class:`LocalZeroOptimizer`)."""
    e, d = plan.expert_parallel, plan.data_parallel
    c = plan.context_parallel  # with C > 1, carved out of dp x cp (as torchtitan does)
    if (d * c) % e:
        where = f"{d} data-parallel replicas" if c == 1 else f"{d} x {c} dp x cp ranks"
        return (
            f"expert parallelism {e} must divide the {where} it is carved out of; re-plan "
            "with an --expert-parallel that divides --data-parallel"
            + (" x --context-parallel" if c > 1 else "")
        )
    return None


def expert_mesh(mesh: Any, dp: Any, degree: int, with_tp: bool = False) -> tuple[Any, Any]:
    """(the expert-parallel mesh of this rank: ``degree`` consecutive ranks of the 1-D mesh
    ``dp`` the gradients are summed over (``mesh["dp"]``, or with context parallelism its
    ``dp x cp`` flattened, as torchtitan carves its EP group out of the data-parallel and
    context-parallel ranks), 1-D, or with ``with_tp`` 2-D ``(ep, tp)``: that EP dimension
    joined with ``mesh["tp"]`` (torch's ``DeviceMesh._concatenate``; the two are orthogonal
    slices of one root mesh, so no new groups), the TP ranks splitting each expert's FFN;
    the 1-D mesh of the ``dp / degree`` ranks holding the same experts, whose expert
    gradients are summed, or None when ``degree`` is dp's size)."""
    replicas = None
    ep = dp
    if dp.size() != degree:
        names = ("dp_between_ep", "ep")
        both = dp._unflatten(0, (dp.size() // degree, degree), names)
        ep, replicas = both["ep"], both["dp_between_ep"]
    if with_tp:
        ep = type(mesh)._concatenate([ep, mesh["tp"]])
    return ep, replicas


def check_mesh_plan(plan: Plan, tied: Sequence[Any] = ()) -> None:
    """Refuse, in one line (:class:`MeshPlanError`), a mesh plan this runtime does not run
    (then the plan's own mesh rules, :func:`autopipe.core.mesh_rules.mesh_problems`);
    ``tied``: the model's parameters tied across chunks (``PlannedStages.tied``)."""
    problem = mesh_schedule_problem(plan, plan.schedule)  # the rule the planner applies
    if problem is not None:  # a plan file made before the planner applied it
        raise MeshPlanError(problem)
    problem = loss_parallel_problem(plan)  # priced with sharded logits; this runtime gathers
    if problem is not None:
        raise MeshPlanError(problem)
    for parameter in tied:  # the rule the planner's search applies (mesh_rules)
        problem = tied_chunks_problem(
            parameter.name, parameter.stages, plan.tensor_parallel, plan.shard
        )
        if problem is not None:
            raise MeshPlanError(problem)
    problems = mesh_problems(plan)  # the plan's own mesh rules, as emit checks them
    if problems:
        raise MeshPlanError(problems[0])


def check_shard_dtypes(shard: str, chunks: Sequence[nn.Module]) -> None:
    """Refuse in one line (:class:`MeshPlanError`) sharding ``shard`` (FSDP2: ``parameters``
    or ``gradients``) of a chunk whose parameters have more than one dtype: FSDP2 gathers a
    chunk's parameters as one flat group (one group per chunk, see :func:`apply_sharding`),
    which takes one dtype, and would fail only at the first step. ``chunks``: every chunk of
    the plan (each rank checks all of them, so all refuse alike)."""
    if shard not in ("parameters", "gradients"):
        return
    for index, chunk in enumerate(chunks):
        dtypes: dict[torch.dtype, str] = {}
        for name, p in chunk.named_parameters():
            dtypes.setdefault(p.dtype, name)
        if len(dtypes) > 1:
            (a, first), (b, second) = list(dtypes.items())[:2]
            raise MeshPlanError(
                f"chunk {index} holds parameters of {len(dtypes)} dtypes ({first} is {a}, "
                f"{second} is {b}), which shard {shard} (FSDP2, one parameter group per "
                "chunk) cannot gather together; cast the model to one dtype or re-plan "
                "with --shard none or optimizer"
            )


def mesh_size_problem(plan: Plan, world_size: int) -> str | None:
    """The one-line refusal of a mesh plan launched on ``world_size`` processes, or None."""
    if plan.expert_parallel > 1:
        problem = expert_plan_problem(plan)
        if problem is not None:
            return problem
    if plan.context_parallel > 1:  # the (pp, dp, cp, tp) mesh: context_parallel.py
        return world_size_problem(plan, world_size)
    if world_size == plan.world_size:
        return None
    pp, dp, tp = plan.mesh_shape
    return (
        f"the plan's mesh is pp {pp} x dp {dp} x tp {tp} = {plan.world_size} processes but "
        f"{world_size} were launched; launch {plan.world_size} (torchrun --nproc-per-node "
        f"{plan.world_size}) or re-plan for {world_size} GPUs"
    )


def build_mesh(plan: Plan, device_type: str) -> Any:
    """``init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=("pp","dp","tp"))``;
    :class:`MeshPlanError` when the world size is not the plan's."""
    problem = mesh_size_problem(plan, dist.get_world_size())
    if problem is not None:
        raise MeshPlanError(problem)
    if plan.context_parallel > 1:
        return build_context_mesh(plan, device_type)
    return init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)


def _styles(gathered: str = "replicated") -> dict[str, Callable[[], Any]]:
    """HF TP-plan word -> torch style, with sequence parallelism (SP) on: row-wise modules
    reduce-scatter their output over the sequence (``Shard(1)``), and a column-wise one
    takes its input as ``gathered`` says (:attr:`SequenceLayout.colwise_inputs`): a norm's
    gathered DTensor or a replicated tensor (``Replicate``), or a local sequence shard
    (``Shard(1)``, gathered by the module)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    seq = Shard(SEQUENCE_DIM)
    into = seq if gathered == "sharded" else Replicate()
    return {
        "colwise": lambda: ColwiseParallel(input_layouts=into),
        "rowwise": lambda: RowwiseParallel(output_layouts=seq),
        # The output gathered to every TP rank (an LM head whose logits the loss reads whole).
        "colwise_rep": lambda: ColwiseParallel(input_layouts=into, output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(
            input_layouts=into, output_layouts=Replicate()
        ),
        # The input replicated, not sharded on its last dim (follows a replicated layer).
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Hugging Face's (transformers 5) name for the same: the input arrives whole (after
        # a gathered column-wise output, or q/k norms over all heads) and the module takes
        # its own share of the input features.
        "rowwise_split_input": lambda: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq
        ),
        # Vocab-parallel embedding: each rank looks up its share of the vocabulary (ids it
        # does not hold give zeros) and the partial sums are reduce-scattered.
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    }


_SPLIT_OUTPUT = ("colwise",)
"""Styles whose module returns one rank's share of its output features."""
_SPLIT_INPUT = ("rowwise",)
"""Styles whose module takes one rank's share of its input features (``rowwise_rep`` and
``rowwise_split_input`` take them whole and split them themselves)."""
_EMBEDDING = ("embedding_rowwise",)
"""Styles of an ``nn.Embedding`` (its vocabulary split)."""


def tp_style(style: str, gathered: str = "replicated") -> Any:
    """The ``torch.distributed.tensor.parallel`` style for an HF TP-plan word (``gathered``:
    how a column-wise module's input arrives, see :func:`_styles`)."""
    styles = _styles(gathered)
    if style not in styles:
        raise MeshPlanError(
            f"TP style {style!r} is not supported by autopipe run (supported: "
            f"{', '.join(TP_STYLES)}); edit the plan's tp_plan or re-plan with "
            "--tensor-parallel 1"
        )
    return styles[style]()


def planned_modules(model: nn.Module, tp_plan: Mapping[str, str], degree: int) -> dict[str, str]:
    """Module path (from the model root) -> style, for every module of ``model`` that
    ``tp_plan`` splits (the first matching pattern wins, as in Hugging Face).
    :class:`MeshPlanError` for a style this runtime lacks, a split module that is not an
    ``nn.Linear``, a split module whose weight another module shares (a tied head:
    :func:`~autopipe.profiler.tensor_parallel.tied_split`), a split dimension that
    ``degree`` does not divide, or a plan that matches nothing."""
    tie = tied_split(model, tp_plan)
    if tie:
        raise MeshPlanError(tie)
    patterns = [(tp_pattern(p), p, s) for p, s in tp_plan.items()]
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        for regex, _, style in patterns:
            if name and regex.fullmatch(name) and style in REPLICATED_TP_STYLES:
                break  # whole on every rank: tp_gradients.py sums what needs summing
            if name and regex.fullmatch(name):
                tp_style(style)  # refuses unknown styles
                kind = nn.Embedding if style in _EMBEDDING else nn.Linear
                if not isinstance(module, kind):
                    raise MeshPlanError(
                        f"the TP plan splits {name} ({type(module).__name__}) but autopipe "
                        f"run splits only nn.{kind.__name__} with {style}; drop it from the "
                        "plan's tp_plan or re-plan with --tensor-parallel 1"
                    )
                dim = (
                    module.num_embeddings
                    if isinstance(module, nn.Embedding)
                    else module.out_features
                    if style in _SPLIT_OUTPUT
                    else module.in_features
                    if style.startswith("rowwise")  # the weight's input features split
                    else module.out_features
                )
                if dim % degree:
                    raise MeshPlanError(
                        f"{name} has {dim} features to split {style} over tensor-parallel "
                        f"degree {degree}, which does not divide them; re-plan with a "
                        "--tensor-parallel that divides the heads"
                    )
                found[name] = style
                break
    if not found:
        raise MeshPlanError(
            f"the plan's tp_plan ({', '.join(list(tp_plan)[:2])}, ...) matches no module of "
            "the model; re-plan for this model or with --tensor-parallel 1"
        )
    return found


def per_head_parameters(
    model: nn.Module, planned: Mapping[str, str], degree: int
) -> dict[str, str]:
    """Parameter path -> the column-wise split projection (path) it is applied per head of,
    for every parameter held per head of such a projection: Cohere's q/k LayerNorm weight
    ``[heads, head_dim]``, applied to the q (k) projection's output viewed
    ``[b, s, heads, head_dim]``. Column-wise TP gives each rank ``heads / degree``
    consecutive heads (the weight's rows ``[r * out / degree, (r + 1) * out / degree)``),
    so such a parameter is split with them, ``Shard(0)`` over the TP mesh
    (:func:`apply_tensor_parallel`): each rank holds and trains its own heads' rows, and its
    gradient of them is whole (a sum over the rank's own positions and heads only).
    A parameter of a module beside the projection (same parent, not split itself) is per
    head when its shape is ``[h, ..., d]`` with ``h > 1`` and ``h * d`` the projection's
    output width (a key norm of ``h`` key/value heads matches the k and v projections
    alike: both split the same heads). :class:`MeshPlanError` when ``degree`` does not
    divide ``h`` (a rank would hold part of a head). ``planned``: :func:`planned_modules`."""
    found: dict[str, str] = {}
    for path, style in planned.items():
        if style not in _SPLIT_OUTPUT:
            continue  # a gathered output (colwise_rep) is whole: a norm after it sees all heads
        projection = model.get_submodule(path)
        width = getattr(projection, "out_features", None)
        if not isinstance(width, int):
            continue
        parent_path, _, _ = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        for name, child in parent.named_children():
            child_path = f"{parent_path}.{name}" if parent_path else name
            if child_path in planned:
                continue
            for leaf, p in child.named_parameters(recurse=False):
                shape = tuple(p.shape)
                where = f"{child_path}.{leaf}"
                if where in found or len(shape) < 2 or shape[0] < 2:
                    continue
                if shape[0] * shape[-1] != width:
                    continue
                if shape[0] % degree:
                    raise MeshPlanError(
                        f"{where} {list(shape)} is per head of the column-wise split {path} "
                        f"and its {shape[0]} heads do not divide over tensor-parallel degree "
                        f"{degree}; re-plan with a --tensor-parallel that divides the heads"
                    )
                found[where] = path
    return found


def _local_linear(module: nn.Linear, style: str, degree: int) -> nn.Linear:
    """An ``nn.Linear`` with one TP rank's shape of ``module`` under ``style`` (its weight
    and bias views of ``module``'s: nothing is allocated, also not on the meta device)."""
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    if style in _SPLIT_OUTPUT:
        weight = weight[: module.out_features // degree]
        bias = None if bias is None else bias[: module.out_features // degree]
    elif style in _SPLIT_INPUT:
        weight = weight[:, : module.in_features // degree]
    local = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(local)
    local.in_features, local.out_features = weight.shape[1], weight.shape[0]
    local.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    local.bias = None if bias is None else nn.Parameter(bias, requires_grad=True)
    return local


@contextlib.contextmanager
def local_shapes(model: nn.Module, planned: Mapping[str, str], degree: int) -> Iterator[None]:
    """Within the block, every module of ``planned`` (path -> style) is replaced in
    ``model`` by one of a TP rank's shape (:func:`_local_linear`), and every parameter
    split with its heads (:func:`per_head_parameters`) by its first ``1 / degree`` rows (a
    view), so that tracing records one rank's sizes; the originals are put back after."""
    # An embedding's output has the same shape on every rank whatever its vocabulary share,
    # so it is traced whole.
    linear = {p: s for p, s in planned.items() if s not in _EMBEDDING}
    per_head = per_head_parameters(model, planned, degree)
    originals = {path: model.get_submodule(path) for path in linear}
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in per_head}
    held = {name: model.get_parameter(name) for name in per_head}
    try:
        for path, style in linear.items():
            module = originals[path]
            assert isinstance(module, nn.Linear)
            model.set_submodule(path, _local_linear(module, style, degree))
        for name, p in held.items():
            rows = p.detach()[: p.shape[0] // degree]
            local = nn.Parameter(rows, requires_grad=p.requires_grad)
            owners[name]._parameters[name.rpartition(".")[2]] = local
        yield
    finally:
        for path, module in originals.items():
            model.set_submodule(path, module)
        for name, p in held.items():
            owners[name]._parameters[name.rpartition(".")[2]] = p


def adopt_modules(
    body: fx.GraphModule,
    model: nn.Module,
    planned: Mapping[str, str],
    per_head: Iterable[str] = (),
) -> None:
    """Put ``model``'s own module (full size, its own parameters) at each path of
    ``planned`` that the stage graph ``body`` holds, in place of the local-shape stand-in
    (or torch.export's attribute holder) it was traced with; likewise ``model``'s own
    (whole) Parameter for each name of ``per_head`` (:func:`per_head_parameters`) that
    ``body`` holds, in place of the rows it was traced with."""
    for path in planned:
        try:
            body.get_submodule(path)
        except AttributeError:
            continue  # another stage's module
        body.set_submodule(path, model.get_submodule(path))
    for name in per_head:
        owner, _, leaf = name.rpartition(".")
        try:
            holder = body.get_submodule(owner)
        except AttributeError:
            continue
        if leaf in holder._parameters:
            holder._parameters[leaf] = model.get_parameter(name)


def call_planned_modules(body: fx.GraphModule, paths: Mapping[str, str]) -> None:
    """Rewrite ``body`` (in place) so each module in ``paths`` is called as a module: an
    ``aten.linear(x, <path>.weight[, <path>.bias])`` of a torch.export graph becomes
    ``call_module(path, x)``, which runs the module's own forward and so the hooks its TP
    style adds. fx graphs already call leaf modules. :class:`MeshPlanError` when a planned
    module's weight is used otherwise (the TP style would not see that use)."""
    graph = body.graph
    gets = {n: n.target for n in graph.nodes if n.op == "get_attr"}
    linear = {torch.ops.aten.linear.default, torch.nn.functional.linear}
    embedding = {torch.ops.aten.embedding.default, torch.nn.functional.embedding}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in linear | embedding:
            continue
        operands: list[Any] = [*node.args, *node.kwargs.values()]
        if node.target in embedding:  # embedding(weight, ids, ...): the module holds the rest
            weight, x, bias = operands[0], operands[1], None
        else:
            x, weight = operands[0], operands[1]
            bias = operands[2] if len(operands) > 2 else None
        target = gets.get(weight) if isinstance(weight, fx.Node) else None
        if not isinstance(target, str) or not target.endswith(".weight"):
            continue
        path = target[: -len(".weight")]
        if path not in paths:
            continue
        module = body.get_submodule(path)
        if isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward:
            # An embedding that does more than the lookup (Gemma's scales its output): the
            # graph holds the rest after the lookup, so the call runs the lookup alone.
            module = _plain_embedding(module)
            body.set_submodule(path, module)
        wanted_bias = getattr(module, "bias", None)
        got_bias = gets.get(bias) if isinstance(bias, fx.Node) else None
        if (wanted_bias is None) != (bias is None) or (
            bias is not None and got_bias != f"{path}.bias"
        ):
            raise MeshPlanError(
                f"{path} is called with a bias that is not its own; the TP plan cannot split "
                "it: drop it from the plan's tp_plan or re-plan with --tensor-parallel 1"
            )
        with graph.inserting_before(node):
            call = graph.call_module(path, (x,))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str):
            owner, _, leaf = node.target.rpartition(".")
            if owner in paths and leaf in body.get_submodule(owner)._parameters:
                raise MeshPlanError(
                    f"{node.target} is used by something other than {owner}'s own forward "
                    "(e.g. a tied weight); the TP plan cannot split it: drop "
                    f"{owner} from the plan's tp_plan or re-plan with --tensor-parallel 1"
                )
    graph.lint()
    body.recompile()


def _plain_embedding(module: nn.Embedding) -> nn.Embedding:
    """An ``nn.Embedding`` with ``module``'s options, weight (the same Parameter) and
    buffers (the same tensors), whose forward is the lookup alone."""
    plain = nn.Embedding.__new__(nn.Embedding)
    nn.Module.__init__(plain)
    for option in (
        "num_embeddings",
        "embedding_dim",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    ):
        setattr(plain, option, getattr(module, option))
    plain._parameters["weight"] = module._parameters["weight"]
    for name, buffer in module._buffers.items():
        persistent = name not in module._non_persistent_buffers_set
        plain.register_buffer(name, buffer, persistent=persistent)
    return plain


def apply_tensor_parallel(
    body: fx.GraphModule,
    planned: Mapping[str, str],
    tp_mesh: Any,
    layout: SequenceLayout,
) -> int:
    """Split ``body``'s modules of ``planned`` (path -> style; the model's own modules,
    :func:`adopt_modules`) over ``tp_mesh`` with ``parallelize_module``, with sequence
    parallelism as ``layout`` says (:mod:`.sequence_parallel`): its norms run
    ``SequenceParallel`` and hand the split modules their output gathered once
    (``PrepareModuleOutput`` Shard(1) -> Replicate), and each replicated value it shards is
    sharded where it is produced (``PrepareModuleOutput`` Replicate -> Shard on an inserted
    ``nn.Identity``); the parameters applied per head of a column-wise module are split
    with its heads (:func:`split_per_head`). The number of modules split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    paths = {p: s for p, s in planned.items() if _holds(body, p)}
    norms = {p: n for p, n in layout.norms.items() if _holds(body, p)}
    split_per_head(body, layout.per_head, tp_mesh)
    if not (paths or norms or layout.transitions or layout.gathers or layout.gradient_sums):
        return 0
    # First, while the graph's nodes still have the names the layout was read with.
    gathers = insert_gathers(body, layout.gathers)
    insert_gradient_sums(body, layout.gradient_sums, lambda: TPGradientSum(tp_mesh))
    call_planned_modules(body, paths)
    held = call_norm_modules(body, norms)
    # Modules that run on the shard as they are (a mixture of experts): called as modules,
    # no style (their parameters stay plain; the runtime sums their gradients over TP).
    call_norm_modules(body, {p: n for p, n in layout.token_modules.items() if _holds(body, p)})
    shards = insert_transitions(body, layout.transitions)
    styles: dict[str, Any] = {
        path: tp_style(style, layout.colwise_inputs.get(path, "replicated"))
        for path, style in paths.items()
    }
    seq = Shard(SEQUENCE_DIM)
    styles.update(
        {
            path: SequenceParallel(
                sequence_dim=SEQUENCE_DIM, use_local_output=path in layout.kept_sharded
            )
            for path in held
        }
    )
    styles.update(
        {
            path: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(dim))
            for path, dim in shards.items()
        }
    )
    # A sharded value an op needs whole (a mixture of experts, a linear no plan splits) is
    # gathered for it; the op then runs on every TP rank alike, so the gradient that comes
    # back is whole and the backward keeps this rank's share of it.
    styles.update(
        {
            path: PrepareModuleOutput(output_layouts=Shard(dim), desired_output_layouts=Replicate())
            for path, dim in gathers.items()
        }
    )
    if styles:
        parallelize_module(body, tp_mesh, styles)
        _keep_buffers_plain(body, paths)
    # Then each norm's output hook gathers it once, as a DTensor: the column-wise modules it
    # feeds take it as it is, and a shape read of it is the whole sequence's.
    gather: dict[str, Any] = {
        path: PrepareModuleOutput(
            output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=False
        )
        for path in held
        if path not in layout.kept_sharded
    }
    if gather:
        parallelize_module(body, tp_mesh, gather)
    return len(paths)


def split_per_head(body: fx.GraphModule, per_head: Mapping[str, str], tp_mesh: Any) -> list[str]:
    """Split each parameter of ``per_head`` (:func:`per_head_parameters`) that ``body``
    holds (whole) with the heads of its projection: a DTensor ``Shard(0)`` over ``tp_mesh``
    (rank ``r`` holds rows ``[r * h / T, (r + 1) * h / T)``, the heads ``ColwiseParallel``
    gives it of the projection), which the graph reads as this rank's rows (a plain tensor,
    as the activations it meets). ``DTensor.to_local``'s backward hands the rows' gradient
    back as the DTensor's own shard, so it is neither summed nor partial. The names split."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    graph = body.graph
    done = []
    for name in per_head:
        owner, _, leaf = name.rpartition(".")
        if not _holds(body, owner) or leaf not in body.get_submodule(owner)._parameters:
            continue
        holder = body.get_submodule(owner)
        p = holder._parameters[leaf]
        assert p is not None
        if not isinstance(p, DTensor):
            split = distribute_tensor(p.detach(), tp_mesh, [Shard(0)])
            holder._parameters[leaf] = nn.Parameter(split, requires_grad=p.requires_grad)
        for node in list(graph.nodes):
            if node.op != "get_attr" or node.target != name:
                continue
            with graph.inserting_after(node):
                rows = graph.call_function(_local_rows, (node,))
            rows.meta = dict(node.meta)
            node.replace_all_uses_with(rows, delete_user_cb=lambda user, r=rows: user is not r)
        done.append(name)
    if done:
        graph.lint()
        body.recompile()
    return done


def _local_rows(p: torch.Tensor) -> torch.Tensor:
    """This TP rank's rows of a parameter split with the heads (:func:`split_per_head`)."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _keep_buffers_plain(body: nn.Module, paths: Iterable[str]) -> None:
    """Put back as plain tensors the buffers ``parallelize_module`` replicated as DTensors
    on the split modules at ``paths``. A split module's forward is torch's own (a linear or
    the bare lookup, :func:`_plain_embedding`) and reads no buffer; what reads one is the
    graph, after the call (Gemma's ``embed_scale`` times the local activations, and export's
    ``_assert_tensor_metadata`` on it, which has no DTensor sharding strategy), so it must
    see the tensor the model holds. A replicated DTensor's local tensor is that tensor."""
    from torch.distributed.tensor import DTensor

    for path in paths:
        module = body.get_submodule(path)
        if type(module).forward not in (nn.Linear.forward, nn.Embedding.forward):
            continue  # a forward of its own may read its buffers alongside DTensor inputs
        for name, buffer in list(module._buffers.items()):
            if isinstance(buffer, DTensor):
                module._buffers[name] = buffer.to_local()


TiedSlots = list[list[tuple[nn.Module, str]]]
"""Groups of (chunk body, qualified parameter name) that hold one shared Parameter."""


def tied_slots(roots: Sequence[nn.Module]) -> TiedSlots:
    """Every Parameter that several slots of ``roots`` (one rank's chunk bodies) hold, as
    the groups of those slots, each ``(body, "path.name")`` (a tied embedding and LM head in
    one chunk or in two chunks of one rank). Read before :func:`apply_tensor_parallel`,
    which replaces a split module's parameters with DTensors one module at a time (and may
    replace a module, :func:`call_planned_modules`) and so unties them (:func:`retie`).
    O(parameters)."""
    slots: dict[int, dict[tuple[int, str], tuple[nn.Module, str]]] = {}
    for root in roots:
        for path, module in root.named_modules(remove_duplicate=False):
            for name, p in module._parameters.items():
                if p is not None:
                    where = f"{path}.{name}" if path else name
                    slots.setdefault(id(p), {})[(id(module), name)] = (root, where)
    return [list(group.values()) for group in slots.values() if len(group) > 1]


def retie(groups: TiedSlots) -> int:
    """Make each group of :func:`tied_slots` hold one Parameter again, after tensor
    parallelism split its holders: the first slot's. The tie holds only when TP placed the
    weight alike in every holder (a vocab-parallel embedding and a column-wise head both
    shard ``[V, H]`` by rows, ``Shard(0)`` over the same TP mesh: one DTensor serves both
    lookups, and both uses' gradients accumulate into its ``.grad``);
    :class:`MeshPlanError` otherwise (the plan's tie rule,
    :func:`~autopipe.profiler.tensor_parallel.tied_split`, refuses such plans before).
    Returns how many slots were re-tied."""
    from torch.distributed.tensor import DTensor

    done = 0
    for group in groups:
        root, where = group[0]
        first = root.get_parameter(where)
        for root, where in group[1:]:
            path, _, name = where.rpartition(".")
            module = root.get_submodule(path)
            p = module._parameters[name]
            if p is first:
                continue
            assert p is not None
            a = (first.placements, first.device_mesh) if isinstance(first, DTensor) else None
            b = (p.placements, p.device_mesh) if isinstance(p, DTensor) else None
            if a != b or first.shape != p.shape:
                raise MeshPlanError(
                    f"a weight tied across modules was split as {a and a[0]} in one and "
                    f"{b and b[0]} in {where}, which unties it; split every holder alike "
                    "(the embedding embedding_rowwise, the head colwise) or none"
                )
            module._parameters[name] = first
            done += 1
    return done


class TPGradientSum(nn.Module):
    """The identity on a value every TP rank holds whole, whose gradient each rank gets only
    its part of (it meets the rank's share of heads after it): DTensor's view of it as a
    replicated value whose gradient is partial, so that the backward reduces the gradient
    to the whole one on every rank (an all-reduce over the TP mesh)."""

    def __init__(self, tp_mesh: Any) -> None:
        super().__init__()
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of any shape, unchanged."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        whole = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return whole.to_local(grad_placements=[Partial()])


def _holds(body: nn.Module, path: str) -> bool:
    try:
        body.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply_sharding(
    chunk: nn.Module, shard: str, dp_mesh: Any, ignored: set[nn.Parameter] | None = None
) -> nn.Module:
    """FSDP2 over ``dp_mesh`` for ``shard`` ``parameters`` (ZeRO-3) or ``gradients``
    (``reshard_after_forward=False``); ``chunk`` as it was for ``none`` and ``optimizer``.
    ``ignored``: parameters FSDP leaves alone (expert shards, already split over the EP
    group).
    The reduce-scatter sums (divide factor 1): the runtime divides every gradient by the
    global item count itself."""
    if shard not in ("parameters", "gradients"):
        return chunk
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ignored = ignored or set()
    if not any(p not in ignored for p in chunk.parameters()):
        return chunk  # nothing to shard: a stage of parameter-free layers
    sharded = fully_shard(
        chunk,
        mesh=dp_mesh,
        reshard_after_forward=shard == "parameters",
        ignored_params=ignored or None,
    )
    assert isinstance(sharded, FSDPModule)
    sharded.set_gradient_divide_factor(1.0)
    # Gloo has no pre-multiplied sum: a plain sum (a factor of 1 scales nothing anyway).
    sharded.set_force_sum_reduction_for_comms(True)
    return chunk


def make_zero_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    parameters: list[nn.Parameter],
    group: Any,
    **options: Any,
) -> Any:
    """ZeRO-1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` of ``optimizer_class``
    over the data-parallel ``group`` (each replica keeps the state of its share of the
    parameters and broadcasts its updated share after ``step``); with tensor-parallel
    (``DTensor``) parameters among them, the same over their local tensors
    (:class:`LocalZeroOptimizer`)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in parameters):
        return LocalZeroOptimizer(optimizer_class, parameters, group, **options)
    return ZeroRedundancyOptimizer(
        parameters, optimizer_class=optimizer_class, process_group=group, **options
    )


class LocalZeroOptimizer:
    """ZeRO-1 of parameters some of which are ``DTensor`` s (TP shards, replicated norms,
    expert shards), which torch's ``ZeroRedundancyOptimizer`` does not take: it runs over
    ``group`` on plain parameters aliasing each one's local tensor (``to_local()``, the same
    storage, so its in-place update and broadcast are the DTensor's). The ranks of ``group``
    hold the same local shards (the same TP / EP coordinate), so they partition them alike;
    each keeps the optimizer state of its share and broadcasts its updated share.

    ``step`` hands each alias its parameter's gradient, summed over ``group`` already (the
    pipeline's data-parallel sum): a ``DTensor`` gradient placed as its parameter first
    (``redistribute``: a replicated parameter's ``Partial`` gradient summed over TP, what
    the optimizer's DTensor ops would do), then its local tensor. The update is elementwise
    (SGD, momentum, AdamW), so on the local tensors it is the DTensors' update."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        parameters: list[nn.Parameter],
        group: Any,
        **options: Any,
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.distributed.tensor import DTensor

        self.parameters = parameters
        self.local = [
            nn.Parameter((p.to_local() if isinstance(p, DTensor) else p).detach())
            for p in parameters
        ]
        self.inner = ZeroRedundancyOptimizer(
            self.local, optimizer_class=optimizer_class, process_group=group, **options
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the gradients are dropped either way (the pipeline sets them)
        for p, local in zip(self.parameters, self.local, strict=True):
            p.grad = local.grad = None

    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        for p, local in zip(self.parameters, self.local, strict=True):
            grad = p.grad
            if isinstance(grad, DTensor):
                assert isinstance(p, DTensor)
                if grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                grad = grad.to_local()
            local.grad = grad
        self.inner.step()
