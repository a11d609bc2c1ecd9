"""``parallelize``: profile, plan and split a model into a running GPipe ``Pipeline``.

    pipe = autopipe.parallelize(model, example_inputs, gpus=4)
    loss_fn(pipe(x), y).backward(); optimizer.step()   # optimizer over pipe.parameters()

Steps: unless a ``plan`` is given, measure a Profile (``autopipe.profiler.measure.profile``) and plan
K stages (``autopipe.planner.plan``); cut the model into the plan's stage graphs
(``autopipe.runtime.planned_stages.partition``, the route the distributed runtime takes too);
build a ``Pipeline`` with ``plan.microbatches`` micro-batches and the plan's per-stage
checkpoint flags. Stage ``i`` runs on ``devices[i]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from autopipe.planner.checkpointing import check_checkpoint_mode, stage_checkpoints
from autopipe.profiler.objective import LossFn
from autopipe.profiler.options import MeasureOptions
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.torch_devices import as_device
from torch import nn

from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT

__all__ = ["parallelize", "stage_devices", "stage_flags"]


def stage_devices(
    devices: Sequence[torch.device | str | int] | None, gpus: int | None, plan: Plan | None
) -> list[torch.device]:
    """Explicit devices, else the first K CUDA devices, else K copies of the CPU.

    K is ``gpus``, else the plan's stage count, else the number of CUDA devices (1 on CPU).
    """
    if gpus is not None and (not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"gpus={gpus!r} must be a positive integer (the number of stages)")
    if devices is not None:
        devs = [as_device(d) for d in devices]
        if not devs:
            raise ValueError("devices is empty; give one device per pipeline stage")
        if gpus is not None and gpus != len(devs):
            raise ValueError(
                f"gpus={gpus} but {len(devs)} devices were given; give one device per stage"
            )
        return devs
    count = gpus or (plan.num_stages if plan is not None else None)
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        count = count or visible
        if count > visible:
            raise ValueError(
                f"{count} stages need {count} devices but only {visible} CUDA devices are visible; "
                "pass devices=[...] explicitly (devices may repeat)"
            )
        return [torch.device("cuda", i) for i in range(count)]
    return [torch.device("cpu")] * (count or 1)


def stage_flags(plan: Plan, checkpoint: str) -> list[bool]:
    """Per-stage re-materialization: the plan's flags for ``"auto"``, else the mode's
    (``"except_last"`` spares the last stage, as the planner models it)."""
    return stage_checkpoints(checkpoint, [bool(s.checkpoint) for s in plan.stages])


def _measure(
    model: nn.Module,
    example_inputs: Any,
    granularity: str,
    options: MeasureOptions | None,
    loss_fn: LossFn | None,
    progress: bool,
) -> Profile:
    from autopipe.profiler.measure import profile

    options = dataclasses.replace(options or MeasureOptions(), granularity=granularity)
    return profile(model, example_inputs, options, loss_fn=loss_fn, progress=progress)


class PlanNeedsRanksError(UsageError, ValueError):
    """A plan that only ``autopipe run`` (torch.distributed) can run: tensor parallelism or
    sharded training state."""


def one_process_refusal(plan: Plan) -> str | None:
    """Why the one-process executor cannot run ``plan`` (one line), or None. It runs every
    stage whole on its own device in one process: no tensor-parallel group to split a layer
    over (T > 1) and no data-parallel replicas to shard the training state over."""
    tensor_parallel, shard = plan.tensor_parallel, plan.shard
    if tensor_parallel > 1:
        return (
            f"the plan splits layers over tensor-parallel degree {tensor_parallel}, which "
            "parallelize() (one process) cannot run: run it with `torchrun ... -m autopipe "
            "run MODEL --plan PLAN.json`, or re-plan with --tensor-parallel 1"
        )
    if shard != "none":
        return (
            f"the plan shards the training state over its replicas (shard {shard}), which "
            "parallelize() (one process, no replicas) cannot do: run it with `torchrun ... "
            "-m autopipe run`, or re-plan with --shard none"
        )
    return None


def _refuse_mesh(plan: Plan) -> None:
    refusal = one_process_refusal(plan)
    if refusal is not None:
        raise PlanNeedsRanksError(refusal)


def parallelize(
    model: nn.Module,
    example_inputs: Any,
    devices: Sequence[torch.device | str | int] | None = None,
    *,
    gpus: int | None = None,
    batch_size: int | None = None,
    microbatches: int | str = "auto",
    checkpoint: str = DEFAULT_CHECKPOINT,
    plan: Plan | None = None,
    granularity: str = "block",
    memory_per_device: int | None = None,
    profile_options: MeasureOptions | None = None,
    loss_fn: LossFn | None = None,
    progress: bool = True,
    deferred_batch_norm: bool = False,
) -> Pipeline:
    """Cut ``model`` into a pipeline over ``devices`` following ``plan`` (made here if None).

    ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs
    (a representative mini-batch). ``batch_size`` defaults to the example's; ``microbatches``
    and ``checkpoint`` are passed to the planner (``checkpoint`` also overrides a given plan's
    per-stage flags unless ``"auto"``). ``deferred_batch_norm`` moves BatchNorm running statistics once
    per mini-batch. Without a plan the model is measured by ``autopipe.profiler.profile``
    with ``profile_options`` (:class:`MeasureOptions`, e.g. ``MeasureOptions(repeat=1)``;
    its ``granularity`` is this call's), the ``loss_fn`` that drives its backward and a
    ``progress`` bar. Returns a ``Pipeline`` with ``pipeline.plan`` set.
    """
    from autopipe.runtime.planned_stages import partition
    from autopipe.runtime.split import StageSplitError

    check_checkpoint_mode(checkpoint)  # before the costly profiling
    if plan is not None:
        _refuse_mesh(plan)
    devs = stage_devices(devices, gpus, plan)
    if plan is None:
        from autopipe.planner import plan as make_plan

        from autopipe.core.request import PlanRequest

        profile = _measure(model, example_inputs, granularity, profile_options, loss_fn, progress)
        plan = make_plan(
            profile,
            PlanRequest(
                gpus=len(devs),
                batch_size=batch_size,
                microbatches=microbatches,
                memory_per_device=memory_per_device,
                checkpoint=checkpoint,
            ),
        )
    _refuse_mesh(plan)  # a plan made here, too: the planner may have chosen a mesh
    if plan.virtual_stages > 1:
        # The single-process executor runs one stage per device, fill-drain.
        raise ValueError(
            f"the plan puts {plan.virtual_stages} chunks on each device ({plan.schedule}); "
            "parallelize() runs one stage per device: run it with `autopipe run` "
            "(torch.distributed) or re-plan with --schedule gpipe"
        )
    if plan.num_stages != len(devs):
        raise ValueError(
            f"the plan has {plan.num_stages} stages but {len(devs)} devices were given; "
            "give one device per stage"
        )
    try:
        planned = partition(model, example_inputs, plan)
    except StageSplitError as exc:
        raise ValueError(str(exc)) from None
    return Pipeline.from_partition(
        planned,
        devs,
        model,
        microbatches=plan.microbatches,
        checkpoint=stage_flags(plan, checkpoint),
        plan=plan,
        deferred_batch_norm=deferred_batch_norm,
        checkpoint_granularity=[s.checkpoint_granularity for s in plan.stages],
    )
