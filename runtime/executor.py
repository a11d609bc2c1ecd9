"""Run K stages over M micro-batches in the GPipe fill-drain schedule.

Each clock cycle's tasks (``schedule.clock_cycles``) are submitted to the workers of their
stages' devices (one submission per device and clock) and the clock ends when all of them
are done, so stages on different devices compute at the same time while a stage never runs
ahead of its input. A task
moves its inputs to the stage's device, draws randomness from its micro-batch's stream
(``rng``), runs the stage (re-materialized when ``checkpoint(i, j)``: per stage, or one
unit at a time when the stage has ``units``) and records its
interval with the ``TimelineRecorder``. With grad enabled each task is a ``StageFunction`` node, so the
caller's ``backward()`` later runs the stages' backwards (see ``stage.py``).
An exception stops the run after its clock and is re-raised in the caller. When every
stage is on one device the tasks run in the caller's thread instead (nothing could overlap).
Cost: M x K tasks, M + K - 1 thread hand-offs per device (tens of microseconds each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from autopipe.runtime.checkpoint import checkpointed
from autopipe.runtime.recorder import TimelineRecorder
from autopipe.runtime.rng import MicrobatchRNG
from autopipe.runtime.schedule import clock_cycles
from autopipe.runtime.stage import StageFunction, phony
from autopipe.runtime.worker import InlineWorker, Worker, worker_for
from torch import nn

__all__ = ["Stage", "run_pipeline"]


@dataclass
class Stage:
    """One partition on one device: ``fn(*values) -> tuple(values)`` on flat values."""

    fn: Callable[..., tuple[Any, ...]]
    device: torch.device
    modules: list[nn.Module] = field(default_factory=list)
    """The stage's modules (BatchNorm buffers are restored after a recomputation)."""
    units: list[Callable[..., tuple[Any, ...]]] = field(default_factory=list)
    """Set when the stage is re-materialized per unit: its units' functions, in order
    (calling them in turn is calling ``fn``), each checkpointed on its own, so the backward
    re-computes one unit at a time. Empty: re-materialized per stage."""


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        # Asynchronous only towards a GPU: a non-blocking GPU -> CPU copy returns pinned
        # memory before the copy is done, and the CPU stage would read it too early.
        return value.to(device, non_blocking=device.type == "cuda")
    return value


def _run_task(
    stage: Stage,
    stage_index: int,
    microbatch: int,
    inputs: Sequence[Any],
    use_checkpoint: bool,
    recorder: TimelineRecorder,
    rng: MicrobatchRNG | None,
) -> tuple[Any, ...]:
    device = stage.device
    # StageFunction tracks only top-level tensors: a tensor inside a tuple/dict value (a
    # ``chunk`` result crossing a cut, a tuple-valued model output) would keep its link to
    # the private graph and its gradient would never reach the earlier stages. So the node
    # sees the flat leaves of the inputs and outputs, and the structures are rebuilt around it.
    in_leaves, in_spec = pytree.tree_flatten(list(inputs))
    out_spec: pytree.TreeSpec | None = None

    def call(*leaves: Any) -> list[Any]:
        nonlocal out_spec
        outputs = stage.fn(*pytree.tree_unflatten(list(leaves), in_spec))
        flat, out_spec = pytree.tree_flatten(tuple(outputs))
        return flat

    def on_recompute() -> AbstractContextManager[None]:
        return recorder.record(stage_index, microbatch, "recompute", device)

    def call_units(*leaves: Any) -> list[Any]:
        # Each unit keeps only its inputs and re-computes on its own in backward.
        nonlocal out_spec
        values: Sequence[Any] = pytree.tree_unflatten(list(leaves), in_spec)
        for unit in stage.units:
            values = checkpointed(unit, values, stage.modules, on_recompute=on_recompute)
        flat, out_spec = pytree.tree_flatten(tuple(values))
        return flat

    def run(*leaves: Any) -> list[Any]:
        moved = [_to_device(v, device) for v in leaves]
        if use_checkpoint and stage.units:
            return call_units(*moved)
        if use_checkpoint:
            return checkpointed(call, moved, stage.modules, on_recompute=on_recompute)
        return call(*moved)

    stream = rng.stream(microbatch, device) if rng is not None else nullcontext()
    with stream, recorder.record(stage_index, microbatch, "forward", device):
        if torch.is_grad_enabled():
            on_backward = partial(recorder.record, stage_index, microbatch, "backward", device)
            out_leaves = StageFunction.apply(run, on_backward, phony(device), *in_leaves)
        else:
            out_leaves = run(*in_leaves)
    assert out_spec is not None
    return tuple(pytree.tree_unflatten(list(out_leaves), out_spec))


def run_pipeline(
    stages: Sequence[Stage],
    microbatches: Sequence[Sequence[Any]],
    *,
    checkpoint: Callable[[int, int], bool],
    recorder: TimelineRecorder,
    rng: MicrobatchRNG | None,
) -> list[tuple[Any, ...]]:
    """Forward every micro-batch through every stage; returns the last stage's outputs per
    micro-batch. ``checkpoint(i, j)`` says whether task (micro-batch i, stage j) is
    re-materialized."""
    if len({str(stage.device) for stage in stages}) == 1:
        # One device: nothing could overlap, so the caller's thread runs every task itself
        # (same order, same results, no hand-offs).
        workers: list[Worker | InlineWorker] = [InlineWorker()] * len(stages)
    else:
        workers = [worker_for(stage.device) for stage in stages]
    values: list[Sequence[Any]] = list(microbatches)
    for clock in clock_cycles(len(values), len(stages)):
        # One hand-off per device and clock: a device's tasks of one clock run in order in
        # one submission (stages sharing a device could not overlap anyway).
        by_worker: dict[Worker | InlineWorker, list[tuple[int, Callable[[], tuple[Any, ...]]]]]
        by_worker = {}
        for i, j in clock:
            task = partial(_run_task, stages[j], j, i, values[i], checkpoint(i, j), recorder, rng)
            by_worker.setdefault(workers[j], []).append((i, task))
        futures = [worker.submit(partial(_run_all, tasks)) for worker, tasks in by_worker.items()]
        # The clock's other tasks finish even when one fails (each is one stage on one
        # micro-batch), so no task of a failed run still mutates modules, BatchNorm sums or
        # generators after the caller has the exception; the lowest stage's error is raised.
        wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        for future in futures:
            for i, out in future.result():
                values[i] = out
    return [tuple(v) for v in values]


def _run_all(
    tasks: list[tuple[int, Callable[[], tuple[Any, ...]]]],
) -> list[tuple[int, tuple[Any, ...]]]:
    return [(i, task()) for i, task in tasks]
