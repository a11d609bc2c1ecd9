"""``build_pipeline``: cut a model into a running ``Pipeline`` as a given Plan says.

    pipe = build_pipeline(model, example_inputs, plan, devices, orders=orders)
    pipe.step(x, y, loss_fn); optimizer.step()   # the plan's schedule; optimizer over pipe.parameters()
    loss_fn(pipe(x), y).backward()                # GPipe plans only

Steps: cut the model into the plan's stage graphs (``autopipe.runtime.planned_stages.partition``,
the route the distributed runtime takes too); build a ``Pipeline`` with ``plan.microbatches``
micro-batches and the plan's per-stage checkpoint flags. Stage ``i`` runs on ``devices[i]``.
Profiling and planning first when there is no plan is the application's
``autopipe.parallelize`` (``autopipe/parallelizing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.planned_stages import partition
from autopipe.runtime.split import StageSplitError
from autopipe.runtime.torch_devices import as_device
from torch import nn

from autopipe.core.checkpointing import check_checkpoint_mode, stage_checkpoints
from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.timeline import Action
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT

__all__ = ["build_pipeline", "stage_devices", "stage_flags"]


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


def build_pipeline(
    model: nn.Module,
    example_inputs: Any,
    plan: Plan,
    devices: Sequence[torch.device | str | int] | None = None,
    *,
    gpus: int | None = None,
    checkpoint: str = DEFAULT_CHECKPOINT,
    deferred_batch_norm: bool = False,
    orders: Sequence[Sequence[Action]] | None = None,
) -> Pipeline:
    """Cut ``model`` into a pipeline over ``devices`` (:func:`stage_devices`) following ``plan``.

    ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs
    (a representative mini-batch). ``checkpoint`` overrides the plan's per-stage flags unless
    ``"auto"`` (:func:`stage_flags`). ``deferred_batch_norm`` moves BatchNorm running
    statistics once per mini-batch. ``orders``: each rank's actions of the plan's schedule
    (``plan.actions``, which ``autopipe.parallelize`` passes),
    which ``Pipeline.step`` runs; required for every schedule but GPipe. The plan's
    ``K x V`` chunks go to the ranks' devices as the schedule places them
    (``autopipe.core.schedule_rules.chunk_ranks``). Refuses plans one process cannot run: a
    mesh (:class:`PlanNeedsRanksError`), a rank count other than the devices', a non-GPipe
    plan without its orders. Returns a ``Pipeline`` with ``pipeline.plan`` set.
    """
    check_checkpoint_mode(checkpoint)
    _refuse_mesh(plan)
    devs = stage_devices(devices, gpus, plan)
    if orders is None and plan.schedule != "gpipe":
        raise ValueError(
            f"the plan runs {plan.schedule}: build_pipeline needs its per-rank orders "
            "(orders=plan.actions, as autopipe.parallelize passes them); without them it "
            "would run GPipe"
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
    ranks = chunk_ranks(plan.schedule, plan.num_stages, plan.virtual_stages)
    return Pipeline.from_partition(
        planned,
        [devs[r] for r in ranks],
        model,
        microbatches=plan.microbatches,
        checkpoint=stage_flags(plan, checkpoint),
        plan=plan,
        deferred_batch_norm=deferred_batch_norm,
        checkpoint_granularity=[s.checkpoint_granularity for s in plan.stages],
        orders=orders,
    )
