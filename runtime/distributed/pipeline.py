"""Run a Plan on torch.distributed with PyTorch's own pipelining runtime.

Every rank builds only its stage (:mod:`autopipe.runtime.distributed.stages`), wraps it in
``torch.distributed.pipelining.PipelineStage`` and drives it with ``ScheduleGPipe`` or
``Schedule1F1B`` at the plan's micro-batch count. With ``W = K x D`` processes each stage has
``D`` replicas whose gradients are averaged with one flat all-reduce per step over the stage's
replica group (see :mod:`autopipe.runtime.distributed.layout` for the rank grid).

Loss convention: ``loss_fn(output, target)`` returns the *mean* over a micro-batch; the
schedule divides gradients by M (``scale_grads=True``), so with equal micro-batches the
gradients equal those of the mean loss over the whole batch, as in single-process training.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from autopipe.planner.plan_data import Plan
from autopipe.profiler.inputs import InputBinder, batch_rows, batch_size_of, split_inputs
from autopipe.profiler.objective import default_loss
from autopipe.runtime.distributed.agree import check_same_plan
from autopipe.runtime.distributed.layout import RankLayout, rank_layout
from autopipe.runtime.distributed.process import group_timeout
from autopipe.runtime.distributed.stages import StageModule, StageSplitError, wire_of
from autopipe.runtime.distributed.tied import TiedGradients
from autopipe.runtime.partition import OUTPUT, PlannedStages, cut_values, partition
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils import _pytree as pytree

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

LossFn = Callable[[Any, Any], torch.Tensor]


class PipelineRankError(RuntimeError):
    """A peer rank failed or stopped answering: this rank cannot continue."""


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
    """This stage's module, materialised on ``device``, wrapped for re-materialization.

    Weights, in order of preference:

    - ``state_dict`` given: a stage on the meta device is allocated on ``device`` with
      ``to_empty`` and the stage's entries are copied in (the other stages are never
      allocated). Missing entries are an error.
    - ``model`` has real parameters: the stage keeps them (build the model with the same seed
      on every rank and the stages equal the single-process model's).
    - ``model`` is on the meta device: the stage is allocated with ``to_empty`` and every
      submodule's ``reset_parameters()`` is re-run under ``torch.manual_seed(init_seed +
      stage)``. That is PyTorch's default init, not custom init code in the model's
      ``__init__``; pass a ``state_dict`` when the exact weights matter.

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
    last = stage == plan.num_stages - 1
    module = StageModule(
        planned.stages[stage],
        checkpoint=bool(plan.stages[stage].checkpoint),
        unflatten=planned.unflatten_output if last else None,
    )
    device = torch.device(device)
    persistent = set(module.body.state_dict())
    lost = [n for n, b in module.body.named_buffers() if b.is_meta and n not in persistent]
    if lost:
        warnings.warn(
            f"stage {stage}: non-persistent buffers {lost[:3]} were built on the meta device "
            "and stay uninitialised; build the model with real weights (--init replicate)",
            stacklevel=2,
        )
    if state_dict is not None:
        own = module.body.state_dict()
        wanted = {k: state_dict[k] for k in own if k in state_dict}
        missing = sorted(set(own) - set(wanted))
        if missing:
            raise StageSplitError(
                f"the state_dict lacks {len(missing)} of stage {stage}'s entries (first: "
                f"{missing[0]!r}); save it from the same model class with model.state_dict()"
            )
        if any(t.is_meta for t in own.values()):
            module.body.to_empty(device=device)
        module.body.load_state_dict(wanted, strict=True, assign=False)
    elif any(t.is_meta for t in module.body.state_dict().values()):
        module.body.to_empty(device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + stage)
            for sub in module.body.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    with torch.no_grad():
                        reset()
    return module.to(device)


def _slice_batch(tree: Any, start: int, stop: int) -> Any:
    return batch_rows(tree, start, stop)


def _short_cause(exc: BaseException) -> str:
    """The gist of a backend error: first line, without gloo's source location and advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0]


def _is_comm_failure(exc: BaseException) -> bool:
    """Errors that mean a peer is gone or silent rather than a bug in this rank's compute."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(
        key in text
        for key in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")
    )


class DistributedPipeline:
    """This rank's part of a K x D pipeline; call :meth:`step` once per training step on every rank.

    ``model``: the whole model (real weights, identical on every rank, or on the meta device,
    see :func:`build_stage`). ``example_inputs``: inputs in the model-file convention (tensor,
    tuple or dict), only traced, never run. ``loss_fn(output, target)``: mean loss of a
    micro-batch, on the model's own output structure (default:
    :func:`autopipe.profiler.objective.default_loss`). The process group must be initialised (:func:`init_distributed`).

    Attributes: ``layout`` (stage/replica of this rank), ``module`` (the stage, an ``nn.Module``
    whose ``parameters()`` are what this rank's optimizer updates), ``schedule``, ``plan``.
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
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call "
                "autopipe.runtime.distributed.init_distributed() first (under torchrun)"
            )
        if plan.schedule not in SCHEDULES:
            raise ValueError(
                f"plan schedule {plan.schedule!r} is not one of {', '.join(SCHEDULES)}; "
                "re-plan with --schedule gpipe or --schedule 1f1b"
            )
        # Before anything else talks to a peer: a rank with another plan or model fails
        # here, within seconds and naming the difference, on every rank.
        check_same_plan(plan, model)
        self.plan = plan
        self.layout: RankLayout = rank_layout(
            dist.get_rank(), dist.get_world_size(), plan.num_stages, plan.replicas
        )
        if len(plan.stages) != plan.num_stages:
            raise StageSplitError(
                f"plan says num_stages={plan.num_stages} but lists {len(plan.stages)} stages"
            )
        self.device = torch.device(device) if device is not None else _default_device()
        self.pipeline_group, self.replica_group = _make_groups(self.layout)
        planned = partition(model, example_inputs, plan)
        self.module = materialize_stage(
            planned,
            plan,
            self.layout.stage,
            device=self.device,
            state_dict=state_dict,
            init_seed=init_seed,
        )
        self._binder: InputBinder = planned.binder
        self._model_keys = set(model.state_dict())
        # A tied parameter is saved under every name the model gives it (the graph may
        # reach it by only one of them).
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self._aliases = {n[0]: n for n in names.values() if len(n) > 1}
        for group in list(self._aliases.values()):
            for name in group:
                self._aliases[name] = group
        # Every rank creates every tie group, in the same order (new_group's rule).
        examples = _stage_examples(
            planned, self.layout.stage, example_inputs, plan, self.device, self.module
        )
        self.tied = TiedGradients(planned.tied, self.layout, self.module)
        del planned
        self.tied.synchronize()
        self._user_loss = loss_fn or default_loss
        self._target: Any = None
        # Shapes given up front: torch's own inference would run each stage on
        # uninitialised buffers, and a stage that indexes with a relayed integer tensor
        # (labels, positions) or reads a relayed size would see garbage.
        self.stage = PipelineStage(
            self.module,
            self.layout.stage,
            plan.num_stages,
            self.device,
            input_args=examples[0] if examples else None,
            output_args=examples[1] if examples else None,
            group=self.pipeline_group,
        )
        try:
            self.schedule = SCHEDULES[plan.schedule](
                self.stage, n_microbatches=plan.microbatches, loss_fn=self._loss, scale_grads=True
            )
        except ValueError as exc:
            raise ValueError(
                f"{plan.schedule} with {plan.microbatches} micro-batches on {plan.num_stages} "
                f"stages is not possible ({exc}); re-plan with more micro-batches or --schedule gpipe"
            ) from exc
        self.steps = 0
        self.last_step_s = 0.0

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        # The schedule splits the arange index like a target; slice the real target with it so
        # any pytree (tuple, dict of tensors, the model inputs themselves) can be the target.
        start, stop = int(index[0]), int(index[-1]) + 1
        target = _slice_batch(self._target, start, stop)
        return self._user_loss(self.module.model_output(output), target)

    def parameters(self) -> Any:
        return self.module.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's ``state_dict()``, under the model's names
        (buffers the model does not persist are left out)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in self.module.body.state_dict().items():
            for name in self._aliases.get(key, [key]):
                if name in self._model_keys:
                    out[name] = value.detach()
        return out

    def local_batch(self, batch: Any) -> Any:
        """This replica's 1/D share (along dim 0) of a global batch given identically to all ranks."""
        size = batch_size_of([batch])
        d = self.layout.replicas
        if size % d:
            raise ValueError(
                f"batch size {size} is not divisible by the {d} data-parallel replicas"
            )
        share = size // d
        return _slice_batch(batch, self.layout.replica * share, (self.layout.replica + 1) * share)

    def step(self, inputs: Any = None, target: Any = None) -> torch.Tensor | None:
        """One training step of this replica's pipeline on its local batch.

        ``inputs`` (needed on the first stage) and ``target`` (needed on the last stage; default:
        the inputs, as for language models) hold the local batch, dim 0 the batch. Gradients are
        accumulated into the stage's parameters (zero them between steps), averaged over the D
        replicas. Returns the mean loss over the global batch on last-stage ranks, else None.
        """
        layout = self.layout
        t0 = time.perf_counter()
        try:
            loss = self._step(inputs, target)
        except Exception as exc:
            if _is_comm_failure(exc):
                first = _short_cause(exc)
                raise PipelineRankError(
                    f"rank {layout.rank} (stage {layout.stage}, replica {layout.replica}): the "
                    f"pipeline broke in step {self.steps + 1}: a peer rank failed or did not answer "
                    f"within the process-group timeout ({first})"
                ) from exc
            # PipelineStage wraps errors of the stage's forward in a RuntimeError whose text is
            # only "[Stage k] failed to run forward: <args>": surface the real cause instead.
            cause = exc.__cause__
            if cause is not None and "failed to run forward" in str(exc):
                raise cause from exc
            raise
        self.last_step_s = time.perf_counter() - t0
        self.steps += 1
        return loss

    def _step(self, inputs: Any, target: Any) -> torch.Tensor | None:
        layout = self.layout
        M = self.plan.microbatches
        args: tuple[Any, ...] = ()
        if layout.is_first_stage:
            if inputs is None:
                raise TypeError("the first stage needs the inputs: step(inputs, target)")
            args = tuple(
                a.to(self.device) if isinstance(a, torch.Tensor) else a
                for a in self._binder(*split_inputs(inputs))
            )
            _check_divisible(batch_size_of(args), M)
        losses: list[torch.Tensor] = []
        if layout.is_last_stage:
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
                self.schedule.step(*args, target=index, losses=losses, return_outputs=False)
            finally:
                self._target = None  # a failed step must not keep the batch alive
        else:
            self.schedule.step(*args, return_outputs=False)
        # A tied parameter's gradient is the sum over the stages holding it, then the mean
        # over replicas, as in the unsplit model trained data-parallel.
        self.tied.reduce_gradients()
        if layout.replicas > 1:
            _average_gradients(self.module, self.replica_group, layout.replicas)
        if not layout.is_last_stage:
            return None
        loss = torch.stack([x.detach() for x in losses]).mean()
        if layout.replicas > 1:
            dist.all_reduce(loss, group=self.replica_group)
            loss /= layout.replicas
        return loss


def _stage_examples(
    planned: PlannedStages,
    stage: int,
    example_inputs: Any,
    plan: Plan,
    device: torch.device,
    module: StageModule,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """Example inputs and outputs of one micro-batch of ``stage`` (shapes, dtypes and
    ``requires_grad`` from a fake-tensor run of the whole graph; values are irrelevant), as
    they travel (``module``'s wire formats are set from the same run). None, with a
    warning, when the graph cannot run on fake tensors."""
    graph = planned.stages[stage]
    rows = batch_rows(example_inputs, 0, int(plan.microbatch_size))
    try:
        values = cut_values(
            planned.graph_module,
            planned.binder.flat(rows),
            set(graph.input_names) | set(graph.output_names),
        )
    except Exception as exc:  # data-dependent shapes: let torch infer them at run time
        warnings.warn(
            f"stage {stage}: shapes of the values between stages could not be worked out "
            f"ahead ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "torch.distributed.pipelining infers them on its first step",
            stacklevel=3,
        )
        return None

    def example(value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            empty = torch.empty(value.shape, dtype=value.dtype, device=device)
            return empty.requires_grad_(bool(value.requires_grad))
        return torch.tensor(value, device=device)  # a number, sent as StageModule sends it

    def examples(names: list[str]) -> tuple[torch.Tensor, ...]:
        # What StageModule sends: every tensor or number leaf of each value, in order.
        return tuple(example(leaf) for name in names for leaf in pytree.tree_leaves(values[name]))

    if stage > 0:
        wires = []
        for name in graph.input_names:
            try:
                wires.append(wire_of(values[name]))
            except TypeError as exc:
                raise StageSplitError(
                    f"value {name!r} crossing the cut before stage {stage} holds {exc}, not "
                    "tensors or numbers; torch.distributed.pipelining sends only tensors "
                    "between ranks: plan a different cut (e.g. --units)"
                ) from None
        module.set_wires(wires)
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


def _average_gradients(module: nn.Module, group: Any, replicas: int) -> None:
    """Average this stage's gradients over its replicas: one flat all-reduce (one bucket)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


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


def _default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` under NCCL (as torchrun numbers a node's ranks), else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
