"""Run a Plan on torch.distributed with PyTorch's own pipelining runtime.

Every rank builds only its chunks (:mod:`autopipe.runtime.distributed.stages`): the plan's
``K x V`` stages in model order, chunk ``c`` on the rank ``plan.stages[c].rank`` (loop or
V-shape placement, :func:`autopipe.core.schedule_rules.chunk_ranks`). Each chunk becomes a
``torch.distributed.pipelining.PipelineStage`` with its global index, and the plan's schedule
class runs them: ``ScheduleGPipe`` / ``Schedule1F1B`` take the rank's one stage, the
multi-stage classes (interleaved 1F1B, looped BFS, interleaved zero-bubble, ZBV, DualPipeV)
take the list, at the plan's micro-batch count. With ``W = K x D`` processes each rank has
``D`` replicas whose gradients are averaged with one flat all-reduce per step over the
rank's replica group (see :mod:`autopipe.runtime.distributed.layout` for the rank grid).
Plans with tensor parallelism or sharded training state run on a (pp, dp, tp) DeviceMesh
(:mod:`autopipe.runtime.distributed.mesh`).

Loss convention (:mod:`autopipe.profiler.objective`): ``loss_fn(output, target)`` sees one
micro-batch and returns its mean over rows or ``(sum, count)``; the default objective weights
a model's own loss by the labelled items it averages over. Torch's schedule runs backward
on each micro-batch's sum; after it the gradients are divided, once per parameter (even when
two chunks of a rank share one), by the count summed over every micro-batch of every
replica, so they are those of the mean over the global batch's items, as in single-process
training.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from autopipe.profiler.inputs import InputBinder, batch_rows, batch_size_of, split_inputs
from autopipe.profiler.objective import LabelItems, LossFn, loss_term
from autopipe.profiler.units import UnitGraph
from autopipe.profiler.weight_pass import reuse_reason
from autopipe.runtime.distributed.agree import check_same_plan
from autopipe.runtime.distributed.context_parallel import (
    AttentionMaskError,
    accepts_positions,
    context_batch,
    gradient_mesh,
    length_problem,
    local_sequence_inputs,
    positions_problem,
    route_attention,
    sequence_buffers,
    sequence_length,
    sharded_step,
    shifted_token_loss,
)
from autopipe.runtime.distributed.expert_parallel import (
    ExpertParallel,
    call_expert_modules,
    expert_modules,
    full_layout,
    split_experts,
    tp_expert_modules,
)
from autopipe.runtime.distributed.failures import (
    PUBLISHED_WAIT_S,
    PipelineRankError,
    failure_board,
    failure_cause,
    is_comm_failure,
    on_every_rank,
    one_line,
    publish_failure,
    short_cause,
)
from autopipe.runtime.distributed.layout import RankLayout, rank_layout, rank_position
from autopipe.runtime.distributed.mesh import (
    MeshPlanError,
    adopt_modules,
    apply_sharding,
    apply_tensor_parallel,
    build_mesh,
    check_mesh_plan,
    check_shard_dtypes,
    expert_mesh,
    local_shapes,
    per_head_parameters,
    planned_modules,
    retie,
    tied_slots,
)
from autopipe.runtime.distributed.process import group_timeout
from autopipe.runtime.distributed.schedule_order import check_torch_order
from autopipe.runtime.distributed.sequence_parallel import (
    SequenceLayout,
    SequenceParallelError,
    adopt_norms,
    sequence_layout,
)
from autopipe.runtime.distributed.stages import StageModule, wire_of
from autopipe.runtime.distributed.tied import TiedGradients
from autopipe.runtime.distributed.tp_gradients import (
    partial_gradient_parameters,
    tp_summed_parameters,
)
from autopipe.runtime.distributed.zero_bubble import weight_pass_misses, weight_pass_reuses
from autopipe.runtime.planned_stages import (
    OUTPUT,
    PlannedStages,
    cut_values,
    partition,
    tied_parameters,
)
from autopipe.runtime.split import StageGraph, StageSplitError
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autopipe.core.errors import UsageError
from autopipe.core.mesh_rules import uses_mesh
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import preflight
from autopipe.core.timeline import Action
from autopipe.core.vocabulary import (
    LOOP_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    TORCH_CLASSES,
    V_SHAPE_SCHEDULES,
)

MULTI_STAGE = frozenset(LOOP_SCHEDULES + V_SHAPE_SCHEDULES)
"""Schedules whose class takes the list of a rank's chunks (``PipelineScheduleMulti``)."""


class ScheduleRuleError(UsageError, ValueError):
    """The plan breaks a rule of its schedule (one line naming the rule, the pre-flight:
    :mod:`autopipe.core.schedule_rules`), or torch's constructor refused it."""


def build_stage(
    model: nn.Module,
    plan: Plan,
    example_inputs: Any,
    stage: int,
    *,
    device: torch.device | str = "cpu",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    init_seed: int = 0,
) -> StageModule:
    """Stage (chunk) ``stage`` of the plan, materialised on ``device``, wrapped for
    re-materialization.

    Weights, in order of preference:

    - ``state_dict`` given: a stage on the meta device is allocated on ``device`` and the
      stage's entries are copied in (the other stages are never allocated). Missing entries
      are an error.
    - ``model`` has real parameters: the stage keeps them (build the model with the same seed
      on every rank and the stages equal the single-process model's).
    - ``model`` is on the meta device: the stage is allocated and every submodule's
      ``reset_parameters()`` is re-run under ``torch.manual_seed(init_seed + stage)``. That
      is PyTorch's default init, not custom init code in the model's ``__init__``; pass a
      ``state_dict`` when the exact weights matter.

    Non-persistent buffers (not in ``state_dict()``, e.g. cached masks) cannot be recovered
    from a meta build: a warning names them; build the model with real weights instead.
    """
    planned = partition(model, example_inputs, plan)
    return materialize_stage(
        planned, plan, stage, device=device, state_dict=state_dict, init_seed=init_seed
    )


def materialize_stage(
    planned: PlannedStages,
    plan: Plan,
    stage: int,
    *,
    device: torch.device | str = "cpu",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    init_seed: int = 0,
) -> StageModule:
    """Stage ``stage`` of ``planned`` as a :class:`StageModule` with real weights on
    ``device`` (the rules of :func:`build_stage`)."""
    return materialize_chunks(
        planned, plan, [stage], device=device, state_dict=state_dict, init_seed=init_seed
    )[0]


def check_state_dict_shapes(
    own: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]
) -> None:
    """StageSplitError naming the first entry of ``given`` whose shape differs from the one
    of that name in ``own`` (a model's or a chunk's ``state_dict()``, on meta or not); torch's
    load_state_dict lists them all over many lines, the first of which says only that
    loading failed."""
    for name, tensor in given.items():
        mine = own.get(name)
        if mine is not None and tuple(tensor.shape) != tuple(mine.shape):
            raise StageSplitError(
                f"the state_dict's {name!r} has shape {list(tensor.shape)} but the model's is "
                f"{list(mine.shape)}; save it from the same model with model.state_dict()"
            )


def materialize_chunks(
    planned: PlannedStages,
    plan: Plan,
    chunks: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    init_seed: int = 0,
) -> list[StageModule]:
    """The chunks ``chunks`` of ``planned`` (one rank's, ascending) as :class:`StageModule`
    s with real weights on ``device`` (the rules of :func:`build_stage`, chunk ``c`` seeded
    with ``init_seed + c``). A parameter two of the chunks share (a tied embedding and head
    on one rank) stays one parameter."""
    modules = _stage_modules(planned, plan, chunks)
    device = torch.device(device)
    _warn_lost_buffers(chunks, modules)
    on_meta = any(t.is_meta for m in modules for t in m.body.state_dict().values())
    if state_dict is not None:
        _load_chunks(chunks, modules, state_dict, on_meta, device)
    elif on_meta:
        _to_empty_keeping_ties([m.body for m in modules], device)
        _reset_chunks(chunks, modules, init_seed)
    return [m.to(device) for m in modules]


def _stage_modules(planned: PlannedStages, plan: Plan, chunks: Sequence[int]) -> list[StageModule]:
    """The chunks ``chunks`` of ``planned`` wrapped as :class:`StageModule` s (weights as
    ``planned`` holds them: real or on the meta device)."""
    last = len(plan.stages) - 1
    zero_bubble = plan.schedule in SPLIT_BACKWARD_SCHEDULES
    return [
        StageModule(
            planned.stages[c],
            checkpoint=bool(plan.stages[c].checkpoint),
            unflatten=planned.unflatten_output if c == last else None,
            # B detaches what a chunk sends on in place (not on the first or last chunk:
            # the first has no B, the last sends nothing).
            own_outputs=zero_bubble and 0 < c < last,
            node_unit=planned.node_unit
            if plan.stages[c].checkpoint and plan.stages[c].checkpoint_granularity == "unit"
            else None,
        )
        for c in chunks
    ]


def _warn_lost_buffers(chunks: Sequence[int], modules: Sequence[StageModule]) -> None:
    """A warning per chunk naming the non-persistent buffers it holds on the meta device
    (no ``state_dict`` can fill them)."""
    for c, module in zip(chunks, modules, strict=True):
        persistent = set(module.body.state_dict())
        lost = [n for n, b in module.body.named_buffers() if b.is_meta and n not in persistent]
        if lost:
            warnings.warn(
                f"stage {c}: non-persistent buffers {lost[:3]} were built on the meta device "
                "and stay uninitialised; build the model with real weights (--init replicate)",
                stacklevel=4,  # materialize_chunks' caller's caller, as before this step
            )


def _load_chunks(
    chunks: Sequence[int],
    modules: Sequence[StageModule],
    state_dict: Mapping[str, torch.Tensor],
    on_meta: bool,
    device: torch.device,
) -> None:
    """Each chunk's entries of ``state_dict`` copied into it (allocated on ``device`` first
    when ``on_meta``); StageSplitError for a missing entry or a shape that differs, before
    anything is allocated."""
    wanted_by_chunk = []
    for c, module in zip(chunks, modules, strict=True):
        own = module.body.state_dict()
        wanted = {k: state_dict[k] for k in own if k in state_dict}
        missing = sorted(set(own) - set(wanted))
        if missing:
            raise StageSplitError(
                f"the state_dict lacks {len(missing)} of stage {c}'s entries (first: "
                f"{missing[0]!r}); save it from the same model class with model.state_dict()"
            )
        check_state_dict_shapes(own, wanted)
        wanted_by_chunk.append(wanted)
    if on_meta:
        _to_empty_keeping_ties([m.body for m in modules], device)
    for module, wanted in zip(modules, wanted_by_chunk, strict=True):
        module.body.load_state_dict(wanted, strict=True, assign=False)


def _reset_chunks(chunks: Sequence[int], modules: Sequence[StageModule], init_seed: int) -> None:
    """Every submodule's ``reset_parameters()`` re-run, chunk ``c`` under
    ``torch.manual_seed(init_seed + c)``, on chunks just allocated from the meta device."""
    # A parameter two of the chunks share (a tied embedding and head in a V) keeps the
    # init of the first chunk using it, as the copies on other ranks do (synchronize).
    seen: dict[int, int] = {}
    shared: set[int] = set()
    for k, module in enumerate(modules):
        for q in module.body.parameters():
            if id(q) in seen:
                shared.add(id(q))
            seen.setdefault(id(q), k)
    first: dict[int, torch.Tensor] = {}
    for k, (c, module) in enumerate(zip(chunks, modules, strict=True)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + c)
            for sub in module.body.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    with torch.no_grad():
                        reset()
        for q in module.body.parameters():
            if seen[id(q)] < k:
                with torch.no_grad():
                    q.copy_(first[id(q)])
            elif id(q) in shared and id(q) not in first:
                first[id(q)] = q.detach().clone()


def _to_empty_keeping_ties(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Allocate every meta parameter and buffer of ``modules`` on ``device`` (uninitialised),
    once per tensor: ``nn.Module.to_empty`` gives each module its own new tensor, which would
    untie a parameter that several modules (or chunks) share."""
    owners: dict[int, list[tuple[dict[str, Any], str]]] = {}  # _parameters / _buffers
    tensors: dict[int, torch.Tensor] = {}
    for root in modules:
        for sub in root.modules():
            for table in (sub._parameters, sub._buffers):
                for key, t in table.items():
                    if t is not None and t.is_meta:
                        owners.setdefault(id(t), []).append((table, key))
                        tensors[id(t)] = t
    for tensor_id, t in tensors.items():
        empty = torch.empty_like(t, device=device)
        new: torch.Tensor = (
            nn.Parameter(empty, requires_grad=t.requires_grad)
            if isinstance(t, nn.Parameter)
            else empty
        )
        for slots, name in owners[tensor_id]:
            if slots.get(name) is t:
                slots[name] = new  # a Parameter's slot gets a Parameter (above)


def _own_copies(tree: Any) -> Any:
    """``tree`` with every tensor cloned (contiguous): context parallelism shards them in
    place, which must not touch the caller's batch."""
    return pytree.tree_map(
        lambda t: (
            t.clone(memory_format=torch.contiguous_format) if isinstance(t, torch.Tensor) else t
        ),
        tree,
    )


def _slice_batch(tree: Any, start: int, stop: int) -> Any:
    return batch_rows(tree, start, stop)


class RankChunks(nn.Module):
    """This rank's chunks (:class:`StageModule`, model order) as one module: ``parameters()``
    lists a parameter two chunks share once, so one optimizer (and one replica average)
    sees each parameter once."""

    def __init__(self, chunks: Sequence[StageModule]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def model_named_parameters(self) -> dict[str, nn.Parameter]:
        """Every chunk's parameters under their names in the original model."""
        out: dict[str, nn.Parameter] = {}
        for chunk in self.chunks:
            assert isinstance(chunk, StageModule)
            out.update(chunk.model_named_parameters())
        return out


class DistributedPipeline:
    """This rank's part of a K x D pipeline; call :meth:`step` once per training step on every rank.

    ``model``: the whole model (real weights, identical on every rank, or on the meta device,
    see :func:`build_stage`). ``example_inputs``: inputs in the model-file convention (tensor,
    tuple or dict), only traced, never run. ``loss_fn(output, target)``: the loss of one
    micro-batch, on the model's own output structure and the micro-batch's rows of the target,
    a mean over rows or ``(sum, count)`` (default: the objective of
    :mod:`autopipe.profiler.objective`). The process group must be initialised
    (:func:`init_distributed`).

    Attributes: ``layout`` (pipeline rank and replica of this rank), ``chunk_indices`` (the
    global indices of this rank's chunks, ascending), ``chunks`` (their :class:`StageModule`
    s), ``module`` (all of them as one ``nn.Module``, :class:`RankChunks`, whose
    ``parameters()`` are what this rank's optimizer updates), ``stages`` (their
    ``PipelineStage`` s), ``holds_first`` / ``holds_last`` (this rank runs chunk 0 / the
    last chunk: it takes the inputs / computes the loss), ``unsplit_chunks`` (zero-bubble
    schedules: this rank's chunks whose backward runs whole in B, with the reason),
    ``schedule``, ``plan``.

    ``orders``: the per-rank actions to hold torch's schedule to (default ``plan.actions``,
    what ``autopipe run`` passes): torch's built schedule must run the same, else
    :class:`~autopipe.runtime.distributed.schedule_order.ScheduleOrderMismatchError`.

    A plan breaking a rule of its schedule (``autopipe.core.schedule_rules``) raises
    :class:`ScheduleRuleError` on every rank, before any stage is built, with the same
    one-line message naming the rule.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        example_inputs: Any,
        loss_fn: LossFn | None = None,
        *,
        device: torch.device | str | None = None,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        init_seed: int = 0,
        orders: Sequence[Sequence[Action]] | None = None,
    ) -> None:
        _require_process_group()
        failure_board()  # where a rank's own failure in a step reaches its peers (a run's own)
        planned = _agreed_stages(model, plan, example_inputs, state_dict)
        chunk_rank = [s.rank if s.rank >= 0 else s.index for s in plan.stages]
        self.plan = plan
        self.device = torch.device(device) if device is not None else _default_device()
        self._rewrite: Any = None
        """C > 1: the attention rewrite of every stage trace (:meth:`_context_stages`)."""
        self._context: tuple[int, bool, bool] | None = None
        """C > 1: (the traced sequence length s, positions added, labels shifted), see
        :mod:`.context_parallel`; None without context parallelism."""
        if plan.context_parallel > 1:
            planned, example_inputs = self._context_stages(model, example_inputs)
        planned, tp_modules, layout = self._join_groups(model, example_inputs, planned)
        self._build_chunks(planned, chunk_rank, state_dict, init_seed)
        self._binder: InputBinder = planned.binder
        self._label_items = planned.label_items
        self._model_keys = set(model.state_dict())
        self._aliases = _parameter_aliases(model)
        examples = _stage_examples(
            planned, self.chunk_indices, example_inputs, plan, self.device, self.chunks, layout
        )
        self.received_shapes: list[list[list[int]]] = (
            [[list(t.shape) for t in inputs] for inputs, _ in examples] if examples else []
        )
        """Per chunk of this rank, the shapes of the tensors it receives (one micro-batch; a
        value sharded over the sequence as one TP rank's share); empty when not known ahead."""
        self._spread_experts()
        self._shard_chunks(tp_modules, layout)
        # Every rank creates every tie group, in the same order (new_group's rule).
        self.tied = TiedGradients(
            planned.tied,
            self.layout,
            dict(zip(self.chunk_indices, self.chunks, strict=True)),
            chunk_rank,
        )
        del planned
        self.tied.synchronize()
        self._user_loss = loss_fn
        if self._context is not None and self._context[2] and loss_fn is None:
            self._user_loss = shifted_token_loss  # the model's own loss, shifted before the split
        self._target: Any = None
        self._items: dict[int, float] = {}
        """The count of each micro-batch (by its first row) whose loss this step computed
        (last stage); keyed, as torch may compute a micro-batch's loss more than once (its
        first step on a stage whose shapes it infers)."""
        self.unsplit_chunks: dict[int, str] = _unsplit_chunks(
            plan, self.chunk_indices, self.chunks, examples
        )
        """Zero-bubble schedules: chunks whose backward runs unsplit in B (their W does
        nothing), with the reason: re-materialized (torch's weight pass would recompute the
        chunk's forward once per parameter group), a parameter the chunk uses more than once
        (a layer called several times: torch's weight pass fails on it), or a parameter
        torch's split weight pass would miss (see :mod:`zero_bubble`)."""
        if plan.trainer.compile:
            # Priced from a profile timed compiled (`autopipe plan --compile`); torch runs
            # no compiled stage in the split-backward schedules, which the plan's rules
            # refused already (no-compile-with-zero-bubble).
            for chunk in self.chunks:
                chunk.compile_body()
        self.stages = self._pipeline_stages(examples)
        self.schedule = _schedule(plan, self.stages, self._loss)
        # The plan's per-rank actions (or the ones given): torch must run the same.
        check_torch_order(self.schedule, plan, plan.actions if orders is None else orders)
        self._start_counters()

    def _build_chunks(
        self,
        planned: PlannedStages,
        chunk_rank: Sequence[int],
        state_dict: Mapping[str, torch.Tensor] | None,
        init_seed: int,
    ) -> None:
        """This rank's chunks (``chunk_indices``, ``chunks``, ``module``), materialised on
        the device (:func:`materialize_chunks`), and whether it holds the first / last."""
        self.chunk_indices = [c for c, r in enumerate(chunk_rank) if r == self.layout.stage]
        num_chunks = len(self.plan.stages)
        self.holds_first = 0 in self.chunk_indices
        self.holds_last = num_chunks - 1 in self.chunk_indices
        self.chunks = materialize_chunks(
            planned,
            self.plan,
            self.chunk_indices,
            device=self.device,
            state_dict=state_dict,
            init_seed=init_seed,
        )
        self.module = RankChunks(self.chunks)
        self._last_chunk = self.chunks[-1] if self.holds_last else None

    def _shard_chunks(self, tp_modules: dict[str, str], layout: SequenceLayout) -> None:
        """A mesh plan's chunks split by TP (``tp_modules``) and sharded by FSDP, in place;
        nothing without a mesh."""
        if self.mesh is not None:
            # After the fake-tensor run above, which the DTensors of TP and FSDP would refuse
            # (the whole graph it runs shares their parameters): TP first, then FSDP over
            # the TP-split parameters (torchtitan's order).
            summed: list[list[str]] = []
            if tp_modules:
                # A tied embedding and head (in one chunk or in two of this rank's) are split
                # module by module, each into a DTensor of its own: one again after.
                ties = tied_slots([chunk.body for chunk in self.chunks])
                for chunk in self.chunks:
                    apply_tensor_parallel(chunk.body, tp_modules, self.mesh["tp"], layout)
                    self._split_experts(chunk, layout)
                retie(ties)
                for chunk in self.chunks:
                    summed.append(tp_summed_parameters(chunk.body, self._partial_gradients))
            for chunk in self.chunks:
                experts = {p for p in chunk.parameters() if id(p) in self.expert_parameters}
                apply_sharding(chunk, self.plan.shard, self.gradient_mesh, experts)
            # FSDP replaces the parameters: look them up by name once it has.
            found = {
                id(p): p
                for chunk, names in zip(self.chunks, summed, strict=False)
                for p in (chunk.body.get_parameter(n) for n in names)
            }
            self.tp_summed.extend(found.values())

    def _split_experts(self, chunk: StageModule, layout: SequenceLayout) -> None:
        """T > 1: the experts modules of ``chunk`` that TP splits (``self.tp_experts``)
        replaced by this rank's slice of every expert's FFN (:mod:`.expert_parallel`,
        :class:`~.expert_parallel.TensorParallelExperts`); with E > 1 as well, by this
        rank's EP share of the experts, each TP-sliced (EP x TP)."""
        ep = (self._ep_mesh, self.experts) if self.experts else None
        renamed, done = split_experts(
            chunk.body,
            self._expert_code,
            self.tp_experts,
            self.mesh["tp"],
            layout.token_modules,
            ep,
        )
        for new, old in renamed.items():  # per-unit re-materialization finds the call
            chunk.adopt_node(new, old)
        self.tp_split_experts.extend(done)
        if ep is not None:
            self.expert_parameters.update(id(p) for m in done.values() for p in m.parameters())

    def _spread_experts(self) -> None:
        """An expert-parallel plan's experts modules (``self.experts``) replaced, in each
        chunk holding one, by this rank's share exchanging tokens over the EP group
        (:mod:`.expert_parallel`); nothing for E = 1. After the fake-tensor run above (the
        all-to-all needs real tensors); the stage shapes do not change."""
        self.expert_parameters: set[int] = set()
        """ids of the expert parameters: each rank owns its own, so they are not summed
        over the data-parallel replicas (only over ``expert_replica_group``)."""
        self.expert_replica_group: Any = None
        """With E < D, the ranks holding the same experts (one per EP group), over which
        the expert gradients are summed; None when E = D (or E = 1)."""
        self._ep_mesh: Any = None
        if not self.experts:
            return
        with_tp = self.plan.tensor_parallel > 1
        ep_mesh, replicas = expert_mesh(
            self.mesh, self.gradient_mesh, self.plan.expert_parallel, with_tp
        )
        if replicas is not None:
            self.expert_replica_group = replicas.get_group()
        self._ep_mesh = ep_mesh
        if with_tp:
            return  # EP x TP: after TP's styles (_split_experts)
        for chunk in self.chunks:
            renamed = call_expert_modules(chunk.body, self.experts)
            for new, old in renamed.items():  # per-unit re-materialization finds the call
                chunk.adopt_node(new, old)
            for path, count in self.experts.items():
                if not any(
                    n.op == "call_module" and n.target == path for n in chunk.body.graph.nodes
                ):
                    continue
                held = chunk.body.get_submodule(path)
                weights = dict(held.named_parameters(recurse=False))
                spread = ExpertParallel(self._expert_code[path], weights, ep_mesh, count)
                chunk.body.set_submodule(path, spread)
                self.expert_parameters.update(id(p) for p in spread.parameters())

    def _start_counters(self) -> None:
        """The step's recorder (none yet) and counters, zero before the first step."""
        self.recorder: Any = None
        """A :class:`autopipe.runtime.recorder.TimelineRecorder` that times each step (mark
        ``"step"``) and each loss (phase ``loss``), or None; set by
        :class:`autopipe.runtime.distributed.recorder.PipelineTrace`, which times the chunks."""
        self.steps = 0
        self.last_step_s = 0.0
        self.last_loss = 0.0
        """The last step's loss over the global batch, on every rank (NaN or infinite when
        any micro-batch's was)."""

    def _context_stages(self, model: nn.Module, example_inputs: Any) -> tuple[PlannedStages, Any]:
        """C > 1 (:mod:`.context_parallel`): the stages traced at one CP rank's sequence
        length, positions as an input, the labels shifted (a causal LM) and attention
        rewritten to the causal call torch's ring attention patches; with the inputs they
        were traced from. :class:`MeshPlanError` (one line) for what cannot run."""
        plan = self.plan
        length = sequence_length(example_inputs)
        if length is None:
            raise MeshPlanError(
                "context parallelism needs inputs with a sequence dimension (dim 1 of "
                "input_ids); re-plan with --context-parallel 1"
            )
        problem = length_problem(length, plan.context_parallel)
        if problem is not None:
            raise MeshPlanError(problem)
        has_labels = isinstance(example_inputs, Mapping) and "labels" in example_inputs
        shift = has_labels and LabelItems.of(model).shifted
        positions = accepts_positions(model)
        self._context = (length, positions, shift)
        local = local_sequence_inputs(
            context_batch(example_inputs, positions, shift), plan.context_parallel
        )
        rows = batch_rows(local, 0, int(plan.microbatch_size))

        def rewrite(graph: UnitGraph) -> None:
            assert graph.binder is not None
            try:
                renamed = route_attention(graph.graph_module, graph.binder.flat(rows))
            except AttentionMaskError as exc:
                raise MeshPlanError(
                    f"{exc}: torch's context_parallel runs causal attention without a mask; "
                    "re-plan with --context-parallel 1"
                ) from None
            for new, old in renamed.items():  # the new call belongs to the old one's unit
                graph.node_unit[new] = graph.node_unit[old]

        self._rewrite = rewrite  # T > 1 traces the stages again (_join_groups): same rewrite
        return partition(model, local, plan, rewrite=rewrite), local

    def _join_groups(
        self, model: nn.Module, example_inputs: Any, planned: PlannedStages
    ) -> tuple[PlannedStages, dict[str, str], SequenceLayout]:
        """This rank's place in the K x D (x T) grid and its process groups (a mesh plan's
        from its DeviceMesh). A plan with T > 1 is cut again at one TP rank's shapes: returns
        the stages to build, the modules TP splits (module path -> TP style) and what runs
        sharded over the sequence (sequence parallelism; degree 1 without TP)."""
        plan = self.plan
        self.mesh: Any = None
        """The (pp, dp, tp) DeviceMesh of a mesh plan (:mod:`.mesh`), else None."""
        tp_modules: dict[str, str] = {}
        layout = SequenceLayout(degree=1, sequence_length=0)
        self.tp_summed: list[nn.Parameter] = []
        """Parameters TP leaves whole that each TP rank applies to its own share of the
        data (:mod:`.tp_gradients`): their gradients are summed over the TP group."""
        self._partial_gradients: dict[str, str] = {}
        self.experts: dict[str, int] = {}
        """Expert parallelism (E > 1): path -> routed expert count of each experts module."""
        self._expert_code: dict[str, nn.Module] = {}
        self.tp_experts: dict[str, dict[str, Any]] = {}
        """T > 1: path -> parameter placements of each experts module TP splits (each
        rank a slice of every expert's intermediate features)."""
        self.whole_experts: dict[str, str] = {}
        """T > 1: path -> why TP leaves an experts module whole (it then runs as any
        module TP does not split)."""
        self.tp_split_experts: list[str] = []
        """The experts modules this rank's chunks hold split by TP."""
        if uses_mesh(plan):
            check_mesh_plan(plan, planned.tied)
            if plan.expert_parallel > 1:
                self.experts = expert_modules(model, plan.expert_parallel)
                self._expert_code = {p: model.get_submodule(p) for p in self.experts}
            check_shard_dtypes(plan.shard, [g.module for g in planned.stages])
            if plan.tensor_parallel > 1:
                # Traced again with one TP rank's shapes (see mesh.py: torch.export writes
                # sizes as numbers); the stages then hold the model's own modules again.
                tp_modules = planned_modules(model, plan.tp_plan, plan.tensor_parallel)
                self.tp_experts, self.whole_experts = tp_expert_modules(model, plan.tensor_parallel)
                self._expert_code.update({p: model.get_submodule(p) for p in self.tp_experts})
                if self.experts and self.whole_experts:
                    path, why = next(iter(self.whole_experts.items()))
                    raise MeshPlanError(
                        f"{path}: {why}, so tensor parallelism cannot split its experts, "
                        "which expert parallelism with TP needs; re-plan with "
                        "--tensor-parallel 1 or --expert-parallel 1"
                    )
                with local_shapes(model, tp_modules, plan.tensor_parallel):
                    planned = partition(
                        model, example_inputs, plan, check_parameters=False, rewrite=self._rewrite
                    )
                layout = planned_sequence_layout(planned, model, tp_modules, example_inputs, plan)
                try:
                    self._partial_gradients = partial_gradient_parameters(
                        planned.graph_module, tp_modules, layout
                    )
                except SequenceParallelError as exc:
                    raise MeshPlanError(str(exc)) from None
                for graph in planned.stages:
                    adopt_modules(graph.module, model, tp_modules, layout.per_head)
                    adopt_norms(graph.module, model, {**layout.norms, **layout.token_modules})
                # The re-trace held stand-ins of the split modules, which share no weight:
                # the ties are those of the model's own modules, adopted back.
                planned.tied = tied_parameters([g.module for g in planned.stages], model)
            self.mesh = build_mesh(plan, self.device.type)
            # Every (dp, tp) coordinate is one pipeline: tp innermost, so rank =
            # pp * (D * T) + dp * T + tp is the K x (D * T) grid of RankLayout.
            self.layout: RankLayout = rank_layout(
                dist.get_rank(),
                dist.get_world_size(),
                plan.num_stages,
                plan.data_parallel * plan.context_parallel * plan.tensor_parallel,
            )
            self.data_parallel_rank = self.mesh["dp"].get_local_rank()
            self.tensor_parallel_rank = self.mesh["tp"].get_local_rank()
            self.pipeline_group = self.mesh["pp"].get_group()
            # A CP rank's gradient is its share of the sequence's: summed over dp x cp.
            self.gradient_mesh = (
                gradient_mesh(self.mesh) if plan.context_parallel > 1 else self.mesh["dp"]
            )
            """The mesh gradients are summed (or FSDP-sharded) over: ``dp``, or ``dp x cp``
            flattened with context parallelism."""
            self.replica_group = self.gradient_mesh.get_group()
        else:
            self.layout = rank_layout(
                dist.get_rank(), dist.get_world_size(), plan.num_stages, plan.data_parallel
            )
            self.data_parallel_rank = self.layout.replica
            self.tensor_parallel_rank = 0
            self.pipeline_group, self.replica_group = _make_groups(self.layout)
        self.data_parallel_size = (
            plan.data_parallel if self.mesh is not None else self.layout.replicas
        )
        """D: replicas of each stage (the batch is split D ways)."""
        self.gradient_ranks = self.data_parallel_size * plan.context_parallel
        """The ranks each gradient is summed over: D x C."""
        return planned, tp_modules, layout

    def _pipeline_stages(self, examples: list[ChunkExamples] | None) -> list[PipelineStage]:
        """A ``PipelineStage`` per chunk of this rank, its input and output shapes given
        (``examples``, from the fake-tensor run) when they could be worked out."""
        num_chunks = len(self.plan.stages)
        # Shapes given up front: torch's own inference would run each stage on
        # uninitialised buffers, and a stage that indexes with a relayed integer tensor
        # (labels, positions) or reads a relayed size would see garbage.
        return [
            PipelineStage(
                module,
                c,
                num_chunks,
                self.device,
                input_args=examples[k][0] if examples else None,
                output_args=examples[k][1] if examples else None,
                group=self.pipeline_group,
                # A builder makes torch run the chunk's whole backward in B, then call the
                # (empty) runner it returns in W.
                dw_builder=_no_weight_pass if c in self.unsplit_chunks else None,
            )
            for k, (c, module) in enumerate(zip(self.chunk_indices, self.chunks, strict=True))
        ]

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        # The schedule splits the arange index like a target; slice the real target with it so
        # any pytree (tuple, dict of tensors, the model inputs themselves) can be the target.
        assert self._last_chunk is not None
        start, stop = int(index[0]), int(index[-1]) + 1
        target = _slice_batch(self._target, start, stop)
        timed = contextlib.nullcontext()
        if self.recorder is not None:  # micro-batches are equal: the index says which
            timed = self.recorder.record(
                len(self.plan.stages) - 1, start // (stop - start), "loss", self.device
            )
        with timed:
            term = loss_term(
                self._last_chunk.model_output(output), target, self._user_loss, self._label_items
            )
        self._items[start] = term.items
        # Backward runs on the micro-batch's sum; _step divides by the global count after.
        loss = term.total
        # The zero-bubble input pass detaches the loss in place, which a view refuses.
        return loss.clone() if loss._is_view() else loss

    def parameters(self) -> Any:
        """This rank's parameters, each once (the chunks may share one)."""
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's entries of the model's ``state_dict()``, under the model's names and
        in its layout (buffers the model does not persist are left out). Collective over
        the TP group when it holds experts split by TP (:func:`.expert_parallel.full_layout`)."""
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            for key, value in chunk.body.state_dict().items():
                for name in self._aliases.get(key, [key]):
                    if name in self._model_keys:
                        # A fused [gate; up] split by TP is written as a plain shard.
                        out[name] = full_layout(value.detach())
        return out

    def local_batch(self, batch: Any) -> Any:
        """This replica's 1/D share (along dim 0) of a global batch given identically to all ranks."""
        size = batch_size_of([batch])
        d, replica = self.data_parallel_size, self.data_parallel_rank
        if size % d:
            raise ValueError(
                f"batch size {size} is not divisible by the {d} data-parallel replicas"
            )
        share = size // d
        return _slice_batch(batch, replica * share, (replica + 1) * share)

    def step(self, inputs: Any = None, target: Any = None) -> torch.Tensor | None:
        """One training step of this replica's pipeline on its local batch.

        ``inputs`` (needed on the first stage) and ``target`` (needed on the last stage; default:
        the inputs, as for language models) hold the local batch, dim 0 the batch. Gradients are
        accumulated into the stage's parameters (zero them between steps), averaged over the D
        replicas. Returns the mean loss over the global batch on last-stage ranks, else None.
        """
        layout = self.layout
        t0 = time.perf_counter()
        timed = contextlib.nullcontext()
        if self.recorder is not None:
            timed = self.recorder.mark("step", self.device)
        try:
            with timed:
                loss = self._step(inputs, target)
        except Exception as exc:
            where = rank_position(
                layout, self.data_parallel_rank, self.tensor_parallel_rank,
                self.plan.tensor_parallel,
            )  # fmt: skip
            if is_comm_failure(exc):
                first = short_cause(exc)
                # The failing rank's own line (failures.py), when it wrote one: the cause
                # (or that rank 0, the store's host, is gone).
                cause_line = failure_cause(PUBLISHED_WAIT_S)
                if cause_line is not None:
                    raise PipelineRankError(
                        f"{where}: the pipeline broke in step {self.steps + 1}: {cause_line}"
                    ) from exc
                raise PipelineRankError(
                    f"{where}: the "
                    f"pipeline broke in step {self.steps + 1}: a peer rank failed or did not answer "
                    f"within the process-group timeout ({first})"
                ) from exc
            cause = stage_error_cause(exc)
            publish_failure(f"{where} failed in step {self.steps + 1}: {one_line(cause or exc)}")
            if cause is not None:
                raise cause from exc
            raise
        self.last_step_s = time.perf_counter() - t0
        self.steps += 1
        return loss

    def _sequence_split(self, length: int | None, args: Any, target: Any) -> Any:
        """C > 1: torch's ``context_parallel`` over the mesh's cp dimension, sharding this
        rank's sequence tensors (``args``, ``target``) in place; a rank that holds neither
        (a middle stage) still needs its SDPA patched, and shards a stand-in."""
        if length is None:
            return contextlib.nullcontext()
        buffers = sequence_buffers([args, target], length)
        if not buffers:
            buffers = [torch.zeros(1, length, device=self.device)]
        return sharded_step(self.mesh["cp"], buffers, self.device.type)

    @contextlib.contextmanager
    def _quiet_fsdp(self) -> Iterator[None]:
        """A block in which FSDP2's warning that a chunk returned a view is silenced: it
        cautions against in-place ops on the view, and torch.distributed.pipelining only
        sends a chunk's outputs on or reads them (zero-bubble schedules, which detach them in
        place, are refused on a mesh)."""
        with warnings.catch_warnings():
            if self.plan.shard in ("parameters", "gradients"):
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            yield

    def _step(self, inputs: Any, target: Any) -> torch.Tensor | None:
        if self._context is None:
            return self._schedule_step(inputs, target, None)
        length, positions, shift = self._context
        target = target if target is not None else inputs
        ready = [
            None if tree is None else _own_copies(context_batch(tree, positions, shift, is_target))
            for tree, is_target in ((inputs, False), (target, True))
        ]
        problem = positions_problem(inputs)
        if problem is not None:
            raise ValueError(problem)
        found = sequence_length(ready[0] if ready[0] is not None else ready[1])
        if found is not None and found != length:
            raise ValueError(
                f"the batch's sequence length {found} is not the {length} the stages were "
                "traced at (context parallelism); use the example inputs' length"
            )
        return self._schedule_step(ready[0], ready[1], length)

    def _schedule_step(self, inputs: Any, target: Any, length: int | None) -> torch.Tensor | None:
        """One step of the schedule; ``length``: the sequence length C > 1 splits (the
        tensors with it as dim 1 are sharded in place by torch's context_parallel)."""
        M = self.plan.microbatches
        args: tuple[Any, ...] = ()
        if self.holds_first:
            if inputs is None:
                raise TypeError("the first stage needs the inputs: step(inputs, target)")
            args = tuple(
                a.to(self.device) if isinstance(a, torch.Tensor) else a
                for a in self._binder(*split_inputs(inputs))
            )
            _check_divisible(batch_size_of(args), M)
        losses: list[torch.Tensor] = []
        self._items = {}
        if self.holds_last:
            target = target if target is not None else inputs
            if target is None:
                raise TypeError("the last stage needs the target: step(inputs, target)")
            self._target = pytree.tree_map(
                lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, target
            )
            try:
                size = batch_size_of([self._target])
                _check_divisible(size, M)
                # On the CPU: _loss reads its ends with int(), which would sync a GPU.
                index = torch.arange(size)
                with self._quiet_fsdp(), self._sequence_split(length, args, self._target):
                    self.schedule.step(*args, target=index, losses=losses, return_outputs=False)
            finally:
                self._target = None  # a failed step must not keep the batch alive
        else:
            with self._quiet_fsdp(), self._sequence_split(length, args, None):
                self.schedule.step(*args, return_outputs=False)
        # The global batch's loss sum and item count: only the last stage of each replica
        # has them, and every rank needs the count to scale its gradients.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        # The T ranks of a tensor-parallel group compute the same loss: one of them counts.
        if self.holds_last and self.tensor_parallel_rank == 0:
            totals[0] = float(torch.stack([x.detach().double() for x in losses]).sum())
            totals[1] = sum(self._items.values())
        dist.all_reduce(totals)
        loss_sum, items = float(totals[0]), float(totals[1])
        self.last_loss = loss_sum / items if items > 0 else 0.0
        # d(sum)/d(w) over the micro-batches, divided by the global count; then a tied
        # parameter's gradient is the sum over the ranks holding it, and the sum over
        # replicas, as in the unsplit model trained data-parallel.
        _scale_gradients(self.module, 1.0 / items if items > 0 else 0.0)
        if self.tp_summed:
            # Each TP rank's gradient of these is its share's part (see tp_gradients.py).
            _sum_gradients(self.tp_summed, self.mesh["tp"].get_group())
        self.tied.reduce_gradients()
        if self.gradient_ranks > 1 and self.plan.shard in ("none", "optimizer"):
            # (FSDP reduce-scatters the sharded modes' gradients inside the schedule.)
            _sum_gradients(
                (p for p in self.module.parameters() if id(p) not in self.expert_parameters),
                self.replica_group,
            )
        if self.expert_replica_group is not None:
            # An expert's gradient already holds its EP group's tokens; the D / E groups
            # holding the same experts saw different tokens (FSDP leaves experts alone).
            _sum_gradients(
                (p for p in self.module.parameters() if id(p) in self.expert_parameters),
                self.expert_replica_group,
            )
        if not self.holds_last:
            return None
        return torch.tensor(self.last_loss, dtype=losses[0].dtype, device=self.device)


def _agreed_stages(
    model: nn.Module,
    plan: Plan,
    example_inputs: Any,
    state_dict: Mapping[str, torch.Tensor] | None,
) -> PlannedStages:
    """The model traced and cut as ``plan`` says, once every rank agrees on plan, model and
    traced graph (:func:`check_same_plan`) and the plan keeps its schedule's rules
    (:class:`ScheduleRuleError`); a rank that could not cut the model (or whose
    ``state_dict`` is another model's) raises that error, as every rank then does."""
    # Trace and cut first (no peer is involved), then agree before anything else talks
    # to a peer: a rank with another plan, model or traced graph, or one that could
    # not cut the model as the plan says, fails here, within seconds and naming the
    # difference, on every rank.
    cut_error: Exception | None = None
    try:
        if state_dict is not None:  # weights of another model: refused like a bad cut
            check_state_dict_shapes(model.state_dict(), state_dict)
        planned: PlannedStages | None = partition(model, example_inputs, plan)
    except Exception as exc:  # every rank hears of it before any raises
        planned, cut_error = None, exc
    check_same_plan(plan, model, planned, one_line(cut_error) if cut_error else None)
    # Then the schedule's rules, the same on every rank: all of them refuse at once.
    # The pre-flight (core, shared with the planner) is the one statement of torch's rules.
    problems = preflight(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise on_every_rank(ScheduleRuleError(f"the plan cannot run: {problems[0]}{more}; re-plan"))
    if cut_error is not None:  # every rank failed alike: each raises its own
        raise on_every_rank(cut_error)
    assert planned is not None
    return planned


def _parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each name of a tied parameter -> every name the model gives it (a tied parameter is
    saved under all of them; the graph may reach it by only one)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    aliases = {n[0]: n for n in names.values() if len(n) > 1}
    for group in list(aliases.values()):
        for name in group:
            aliases[name] = group
    return aliases


def _unsplit_chunks(
    plan: Plan,
    chunk_indices: Sequence[int],
    chunks: Sequence[StageModule],
    examples: list[ChunkExamples] | None,
) -> dict[int, str]:
    """Under a zero-bubble schedule, this rank's chunks whose backward must run whole in B,
    with the reason (see :attr:`DistributedPipeline.unsplit_chunks`). The plan decides
    (``StagePlan.split_backward``); what only the traced chunk shows (a parameter its split
    weight pass would take twice or miss, or shapes that could not be worked out) runs it
    unsplit too, with a warning when the plan had it split (its predicted B/W is then off);
    plans that do not record it are decided here alone. {} under other schedules."""
    unsplit: dict[int, str] = {}
    if plan.schedule not in SPLIT_BACKWARD_SCHEDULES:
        return unsplit
    last = len(plan.stages) - 1
    for k, (c, module) in enumerate(zip(chunk_indices, chunks, strict=True)):
        if c == 0:
            continue  # torch runs the first chunk's whole backward in W
        planned = plan.stages[c].split_backward
        if module.checkpoint:
            unsplit[c] = "re-materialized"
            continue
        if planned is False:
            unsplit[c] = "the plan runs it unsplit (a parameter used more than once in it)"
            continue
        if examples is None:  # no fake-tensor run: cannot check, so do not split
            unsplit[c] = "its shapes could not be worked out ahead"
            continue
        reused = _weight_pass_reuses(module, examples[k][0])
        if reused:
            unsplit[c] = reuse_reason(reused, "chunk")
            if planned:
                warnings.warn(
                    f"chunk {c}: the plan splits its backward but {unsplit[c]}",
                    stacklevel=3,
                )
            continue
        missed = _weight_pass_misses(module, examples[k][0], c == last)
        if missed:
            more = f" (and {len(missed) - 1} more)" if len(missed) > 1 else ""
            unsplit[c] = f"the weight pass would miss {missed[0]!r}{more}"
            warnings.warn(
                f"chunk {c}: {plan.schedule}'s weight pass would miss the gradient "
                f"of {missed[0]!r}{more}, which reaches the chunk's outputs without "
                "meeting an input that needs a gradient; this chunk runs its whole "
                "backward in B",
                stacklevel=3,
            )
    return unsplit


def _schedule(
    plan: Plan, stages: list[PipelineStage], loss: Callable[[Any, torch.Tensor], torch.Tensor]
) -> Any:
    """The plan's torch.distributed.pipelining schedule over this rank's ``stages``, with
    ``loss`` per micro-batch; :class:`ScheduleRuleError` when torch refuses it."""
    schedule_class = getattr(pipelining, TORCH_CLASSES[plan.schedule])
    # Gradients are divided by M after the schedule, once per parameter: torch's own
    # scaling divides per stage, twice for a parameter two chunks of a rank share.
    options = dict(n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    try:
        if plan.schedule in MULTI_STAGE:
            return schedule_class(stages, **options)
        return schedule_class(stages[0], **options)
    except (ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ScheduleRuleError(
            f"torch refuses {plan.schedule} with {plan.microbatches} micro-batches on "
            f"{plan.num_stages} ranks x {plan.virtual_stages} chunks: {first}; re-plan"
        ) from exc


def _no_weight_pass() -> Callable[[], None]:
    """``dw_builder`` of a chunk whose backward runs whole in B: its W does nothing."""
    return _nothing


def _nothing() -> None:
    return None


def _weight_pass_misses(module: StageModule, inputs: Sequence[Any], last: bool) -> list[str]:
    """:func:`~autopipe.runtime.distributed.zero_bubble.weight_pass_misses` of one chunk
    (its forward on fake tensors, without re-materialization: the autograd graph is the
    same); a chunk that cannot run on fake tensors runs unsplit, to be safe."""
    checkpoint, module.checkpoint = module.checkpoint, False
    try:
        return weight_pass_misses(module, inputs, last)
    except Exception as exc:  # data-dependent shapes: cannot tell, so do not split
        return [f"<unknown: {type(exc).__name__}>"]
    finally:
        module.checkpoint = checkpoint


def _weight_pass_reuses(module: StageModule, inputs: Sequence[Any]) -> dict[str, int]:
    """:func:`~autopipe.runtime.distributed.zero_bubble.weight_pass_reuses` of one chunk
    (without re-materialization, as :func:`_weight_pass_misses`); a chunk that cannot run on
    fake tensors is left to :func:`_weight_pass_misses`, which runs it unsplit."""
    checkpoint, module.checkpoint = module.checkpoint, False
    try:
        return weight_pass_reuses(module, inputs)
    except Exception:  # data-dependent shapes: _weight_pass_misses says unknown
        return {}
    finally:
        module.checkpoint = checkpoint


ChunkExamples = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def planned_sequence_layout(
    planned: PlannedStages,
    model: nn.Module,
    tp_modules: Mapping[str, str],
    example_inputs: Any,
    plan: Plan,
) -> SequenceLayout:
    """The sequence-parallel layout of ``planned``'s whole graph
    (:func:`.sequence_parallel.sequence_layout`), from one fake-tensor run of a
    micro-batch, with the parameters split with the heads of a column-wise module
    (:func:`.mesh.per_head_parameters`); :class:`MeshPlanError` where it cannot run sharded."""
    rows = batch_rows(example_inputs, 0, int(plan.microbatch_size))
    graph_module = planned.graph_module
    names = {n.name for n in graph_module.graph.nodes}
    values = cut_values(graph_module, planned.binder.flat(rows), names)
    try:
        layout = sequence_layout(graph_module, model, tp_modules, values, plan.tensor_parallel)
    except SequenceParallelError as exc:
        raise MeshPlanError(str(exc)) from None
    layout.per_head = per_head_parameters(model, tp_modules, plan.tensor_parallel)
    return layout


def _stage_examples(
    planned: PlannedStages,
    chunks: Sequence[int],
    example_inputs: Any,
    plan: Plan,
    device: torch.device,
    modules: Sequence[StageModule],
    layout: SequenceLayout | None = None,
) -> list[ChunkExamples] | None:
    """Per chunk of ``chunks``, example inputs and outputs of one micro-batch (shapes,
    dtypes and ``requires_grad`` from one fake-tensor run of the whole graph; values are
    irrelevant), as they travel (the ``modules``' wire formats are set from the same run;
    a value ``layout`` shards over the sequence travels as one TP rank's shard).
    None, with a warning, when the graph cannot run on fake tensors."""
    graphs = [planned.stages[c] for c in chunks]
    values = _boundary_values(planned, chunks, graphs, example_inputs, plan)
    if values is None:
        return None
    found: list[ChunkExamples] = []
    for stage, graph, module in zip(chunks, graphs, modules, strict=True):
        if stage > 0:
            module.set_wires(_input_wires(values, graph.input_names, stage))
        found.append(_chunk_examples(stage, graph, values, device, layout))
    return found


def _boundary_values(
    planned: PlannedStages,
    chunks: Sequence[int],
    graphs: Sequence[StageGraph],
    example_inputs: Any,
    plan: Plan,
) -> dict[str, Any] | None:
    """The values (fake tensors, numbers, pytrees of them) that ``graphs`` take and give, by
    node name, from one fake-tensor run of one micro-batch; None, with a warning, when the
    graph cannot run on fake tensors."""
    rows = batch_rows(example_inputs, 0, int(plan.microbatch_size))
    try:
        return cut_values(
            planned.graph_module,
            planned.binder.flat(rows),
            {n for g in graphs for n in (*g.input_names, *g.output_names)},
        )
    except Exception as exc:  # data-dependent shapes: let torch infer them at run time
        warnings.warn(
            f"stages {list(chunks)}: shapes of the values between stages could not be worked "
            f"out ahead ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "torch.distributed.pipelining infers them on its first step",
            stacklevel=4,  # _stage_examples' caller's caller, as before this step
        )
        return None


def _input_wires(values: Mapping[str, Any], names: Sequence[str], stage: int) -> list[Any]:
    """The wire format (:func:`wire_of`) of each value ``names`` that crosses the cut before
    ``stage``; StageSplitError for one that holds something other than tensors or numbers."""
    wires = []
    for name in names:
        try:
            wires.append(wire_of(values[name]))
        except TypeError as exc:
            raise StageSplitError(
                f"value {name!r} crossing the cut before stage {stage} holds {exc}, "
                "not tensors or numbers; torch.distributed.pipelining sends only "
                "tensors between ranks: plan a different cut (e.g. --units)"
            ) from None
    return wires


def _chunk_examples(
    stage: int,
    graph: StageGraph,
    values: Mapping[str, Any],
    device: torch.device,
    layout: SequenceLayout | None,
) -> ChunkExamples:
    """Example inputs and outputs of chunk ``stage`` (``graph``) on ``device``, empty tensors
    shaped as ``values`` (one TP rank's share where ``layout`` shards them), as they travel."""

    def example(value: Any, name: str = "") -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            shape = layout.local_shape(name, value.shape) if layout else list(value.shape)
            empty = torch.empty(shape, dtype=value.dtype, device=device)
            return empty.requires_grad_(bool(value.requires_grad))
        return torch.tensor(value, device=device)  # a number, sent as StageModule sends it

    def examples(names: list[str]) -> tuple[torch.Tensor, ...]:
        # What StageModule sends: every tensor or number leaf of each value, in order.
        return tuple(
            example(leaf, name) for name in names for leaf in pytree.tree_leaves(values[name])
        )

    inputs = (
        examples(graph.input_names)
        if stage > 0
        else tuple(example(values[name]) for name in graph.input_names)
    )
    if graph.output_names:
        outputs = examples(graph.output_names)
    else:
        leaves = pytree.tree_leaves(values[OUTPUT])
        outputs = tuple(example(v) for v in leaves if isinstance(v, torch.Tensor))
    return inputs, outputs


def _check_divisible(batch_size: int, microbatches: int) -> None:
    # Equal micro-batches make the mean of micro-batch losses the whole-batch mean.
    if batch_size % microbatches:
        raise ValueError(
            f"local batch size {batch_size} is not divisible by the plan's {microbatches} "
            "micro-batches; use a multiple of it"
        )


def _scale_gradients(module: nn.Module, factor: float) -> None:
    """Multiply every gradient of ``module``'s parameters (each parameter once) by ``factor``."""
    if factor != 1.0:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


_STAGE_WRAPPERS = ("failed to run forward", "Failed to run stage backward")
"""What torch.distributed.pipelining's RuntimeError says when it wraps an error of a stage's
forward or backward: only that, and the stage's argument shapes over several lines."""


def stage_error_cause(exc: BaseException) -> BaseException | None:
    """The error a stage's forward or backward raised, when ``exc`` is torch's wrapper of it
    (whose text would hide it: the cause shows only with a full traceback); else None."""
    cause = exc.__cause__
    if cause is not None and any(words in str(exc) for words in _STAGE_WRAPPERS):
        return cause
    return None


def _sum_gradients(parameters: Iterable[nn.Parameter], group: Any) -> None:
    """Sum the gradients of ``parameters`` over ``group`` (a stage's replicas, a TP group):
    one flat all-reduce (one bucket)."""
    # A sharded gradient is summed shard by shard: the group's ranks hold the same shard.
    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _make_groups(layout: RankLayout) -> tuple[Any, Any]:
    """(this rank's pipeline group, this rank's replica group). Every rank creates every group
    in the same order, as ``new_group`` requires; with D = 1 the pipeline is the whole world.
    Each group gets the world's timeout (``new_group`` would otherwise wait 30 minutes)."""
    if layout.replicas == 1:
        return None, None
    pipeline_group = replica_group = None
    timeout = group_timeout()
    for replica in range(layout.replicas):
        group = dist.new_group(layout.pipeline_ranks(replica), timeout=timeout)
        if replica == layout.replica:
            pipeline_group = group
    for stage in range(layout.num_stages):
        group = dist.new_group(layout.replica_ranks(stage), timeout=timeout)
        if stage == layout.stage:
            replica_group = group
    return pipeline_group, replica_group


def _require_process_group() -> None:
    """RuntimeError unless torch.distributed's default process group is initialised."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call "
            "autopipe.runtime.distributed.init_distributed() first (under torchrun)"
        )


def _default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL (as torchrun numbers a node's ranks), else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
