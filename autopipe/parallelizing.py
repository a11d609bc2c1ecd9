"""``parallelize``: profile, plan and split a model into a running ``Pipeline``.

    pipe = autopipe.parallelize(model, example_inputs, gpus=4)
    pipe.step(x, y, loss_fn); optimizer.step()   # the plan's schedule, e.g. 1F1B
    loss_fn(pipe(x), y).backward()                # also, where the plan is GPipe

Steps: unless a ``plan`` is given, measure a Profile (``autopipe.profiler.measure.profile``)
and plan K stages (``autopipe.planner.plan``); then the runtime cuts the model into the
plan's stage graphs and builds the ``Pipeline``
(:func:`autopipe.runtime.parallelize.build_pipeline`) with the plan's per-rank orders
(``plan.actions``), which ``Pipeline.step`` runs. Rank ``r``'s chunks run on ``devices[r]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from autopipe.core.checkpointing import check_checkpoint_mode
from autopipe.core.plan import Plan
from autopipe.core.profile import Profile
from autopipe.core.request import Checkpoint, PlanRequest
from autopipe.core.vocabulary import DEFAULT_CHECKPOINT
from autopipe.planner import plan as make_plan
from autopipe.profiler.measure import profile
from autopipe.profiler.objective import LossFn
from autopipe.profiler.options import MeasureOptions
from autopipe.runtime.parallelize import build_pipeline, stage_devices
from autopipe.runtime.pipeline import Pipeline

__all__ = ["parallelize"]


def _measure(
    model: nn.Module,
    example_inputs: Any,
    granularity: str,
    options: MeasureOptions | None,
    loss_fn: LossFn | None,
    progress: bool,
) -> Profile:
    options = dataclasses.replace(options or MeasureOptions(), granularity=granularity)
    return profile(model, example_inputs, options, loss_fn=loss_fn, progress=progress)


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
    per-stage flags unless ``"auto"``). ``deferred_batch_norm`` moves BatchNorm running
    statistics once per mini-batch. Without a plan the model is measured by ``autopipe.profiler.profile``
    with ``profile_options`` (:class:`MeasureOptions`, e.g. ``MeasureOptions(repeat=1)``;
    its ``granularity`` is this call's), the ``loss_fn`` that drives its backward and a
    ``progress`` bar. Returns a ``Pipeline`` with ``pipeline.plan`` set; train it with
    ``pipeline.step(...)``, which runs the plan's schedule (``pipe(x)`` + ``loss.backward()``
    runs GPipe, and is refused for any other schedule).
    """
    check_checkpoint_mode(checkpoint)  # before the costly profiling
    if plan is None:
        devs = stage_devices(devices, gpus, None)  # bad devices refused before profiling
        measured = _measure(model, example_inputs, granularity, profile_options, loss_fn, progress)
        plan = make_plan(
            measured,
            PlanRequest(
                gpus=len(devs),
                batch_size=batch_size,
                microbatches=microbatches,
                memory_per_device=memory_per_device,
                checkpoint=cast(Checkpoint, checkpoint),  # checked above
            ),
        )
        devices, gpus = devs, None
    return build_pipeline(
        model,
        example_inputs,
        plan,
        devices,
        gpus=gpus,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        orders=plan.actions,
    )
