"""Run K stages over M micro-batches in the GPipe fill-drain schedule, or in any schedule's order.

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

:func:`run_actions` runs any schedule instead: each rank's own list of ``Action`` s (the
plan's ``actions``), forward and explicit per-(chunk, micro-batch) backwards, whole or
split into input and weight gradients (``Pipeline.step``).
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

from autopipe.core.timeline import Action

__all__ = ["ActionRun", "ScheduleOrderError", "Stage", "run_actions", "run_pipeline"]


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


def _stage_runner(
    stage: Stage,
    stage_index: int,
    microbatch: int,
    in_spec: pytree.TreeSpec,
    use_checkpoint: bool,
    recorder: TimelineRecorder,
) -> tuple[Callable[..., list[Any]], Callable[[], pytree.TreeSpec]]:
    """``run(*leaves) -> out_leaves``: the stage on its flat inputs (moved to its device,
    re-materialized when ``use_checkpoint``), and ``out_spec()``: its outputs' structure
    once ``run`` ran."""
    device = stage.device
    out_spec: list[pytree.TreeSpec] = []

    def call(*leaves: Any) -> list[Any]:
        outputs = stage.fn(*pytree.tree_unflatten(list(leaves), in_spec))
        flat, spec = pytree.tree_flatten(tuple(outputs))
        out_spec[:] = [spec]
        return flat

    def on_recompute() -> AbstractContextManager[None]:
        return recorder.record(stage_index, microbatch, "recompute", device)

    def call_units(*leaves: Any) -> list[Any]:
        # Each unit keeps only its inputs and re-computes on its own in backward.
        values: Sequence[Any] = pytree.tree_unflatten(list(leaves), in_spec)
        for unit in stage.units:
            values = checkpointed(unit, values, stage.modules, on_recompute=on_recompute)
        flat, spec = pytree.tree_flatten(tuple(values))
        out_spec[:] = [spec]
        return flat

    def run(*leaves: Any) -> list[Any]:
        moved = [_to_device(v, device) for v in leaves]
        if use_checkpoint and stage.units:
            return call_units(*moved)
        if use_checkpoint:
            return checkpointed(call, moved, stage.modules, on_recompute=on_recompute)
        return call(*moved)

    return run, lambda: out_spec[0]


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
    run, out_spec = _stage_runner(stage, stage_index, microbatch, in_spec, use_checkpoint, recorder)
    stream = rng.stream(microbatch, device) if rng is not None else nullcontext()
    with stream, recorder.record(stage_index, microbatch, "forward", device):
        if torch.is_grad_enabled():
            on_backward = partial(recorder.record, stage_index, microbatch, "backward", device)
            out_leaves = StageFunction.apply(run, on_backward, phony(device), *in_leaves)
        else:
            out_leaves = run(*in_leaves)
    return tuple(pytree.tree_unflatten(list(out_leaves), out_spec()))


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


# -- any schedule: each rank's own order of actions ----------------------------------------


class ScheduleOrderError(ValueError):
    """Per-rank action orders the executor cannot run (an action whose input never comes)."""


@dataclass
class ActionRun:
    """What :func:`run_actions` did: ``terms[i]`` is ``loss_of(i, outputs)`` of micro-batch
    ``i`` (its autograd graph already consumed by backward), ``executed[r]`` rank ``r``'s
    actions in the order they ran (equal to the orders given)."""

    terms: list[Any]
    executed: list[list[Action]]


@dataclass
class _Saved:
    """One (chunk, micro-batch)'s forward, kept for its backward: the detached input leaves
    (the gradient of those that require grad goes to the chunk before) and the tensors to
    run backward from, with the gradients arriving for them."""

    leaves: list[Any]
    outputs: list[torch.Tensor]
    positions: list[int]
    """Where each of ``outputs`` is among the chunk's flat outputs (the next chunk's leaves)."""
    grads: list[torch.Tensor] | None = None


class _ActionState:
    """The values between actions: outputs of forwards, gradients of backwards."""

    def __init__(self, num_chunks: int, microbatches: Sequence[Sequence[Any]]) -> None:
        self.last = num_chunks - 1
        self.inputs: dict[tuple[int, int], list[Any]] = {}  # (chunk, mb) -> flat input leaves
        self.specs: dict[tuple[int, int], pytree.TreeSpec] = {}
        for i, mb in enumerate(microbatches):
            leaves, spec = pytree.tree_flatten(list(mb))
            self.inputs[(0, i)], self.specs[(0, i)] = leaves, spec
        self.saved: dict[tuple[int, int], _Saved] = {}
        self.done: set[Action] = set()

    def ready(self, action: Action) -> bool:
        c, i, phase = action
        if phase == "forward":
            return (c, i) in self.inputs
        if phase == "backward_weight":
            return Action(c, i, "backward_input") in self.done
        saved = self.saved.get((c, i))
        return saved is not None and (c == self.last or saved.grads is not None)


def _forward_action(
    stage: Stage,
    action: Action,
    inputs: tuple[list[Any], pytree.TreeSpec],
    is_last: bool,
    use_checkpoint: bool,
    recorder: TimelineRecorder,
    rng: MicrobatchRNG | None,
    loss_of: Callable[[int, tuple[Any, ...]], Any] | None,
    saving: Callable[[], AbstractContextManager[None]],
) -> tuple[list[Any], pytree.TreeSpec, _Saved, Any]:
    c, i, _ = action
    in_leaves = [_detach_leaf(v) for v in inputs[0]]
    run, out_spec = _stage_runner(stage, c, i, inputs[1], use_checkpoint, recorder)
    stream = rng.stream(i, stage.device) if rng is not None else nullcontext()
    term = None
    with stream, saving(), torch.enable_grad():
        # The last chunk's forward includes its micro-batch's loss (and its backward the
        # loss's), as the plan's last stage does.
        with recorder.record(c, i, "forward", stage.device):
            out_leaves = run(*in_leaves)
            if is_last and loss_of is not None:
                term = loss_of(i, tuple(pytree.tree_unflatten(list(out_leaves), out_spec())))
    if term is not None:
        positions = [0] if term.total.requires_grad else []
        roots = [term.total] if positions else []
    else:
        positions = [
            p for p, t in enumerate(out_leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        roots = [out_leaves[p] for p in positions]
    passed = [v.detach() if isinstance(v, torch.Tensor) else v for v in out_leaves]
    for kept, out in zip(passed, out_leaves, strict=True):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            kept.requires_grad_(True)
    return passed, out_spec(), _Saved(in_leaves, roots, positions), term


def _check_orders(orders: Sequence[Sequence[Action]], chunks: int, microbatches: int) -> None:
    """Refuse orders that do not run every (chunk, micro-batch) forward once and its backward
    once, whole or as input then weight gradient (one line naming the first problem)."""
    seen: dict[Action, int] = {}
    for r, order in enumerate(orders):
        for action in order:
            if not (0 <= action.stage < chunks and 0 <= action.microbatch < microbatches):
                raise ScheduleOrderError(
                    f"rank {r}'s action {action} is outside {chunks} chunks x "
                    f"{microbatches} micro-batches"
                )
            if action.phase not in ("forward", "backward", "backward_input", "backward_weight"):
                raise ScheduleOrderError(f"rank {r}'s action {action} is not a compute phase")
            seen[action] = seen.get(action, 0) + 1
    for c in range(chunks):
        for i in range(microbatches):
            whole = seen.get(Action(c, i, "backward"), 0)
            split = [seen.get(Action(c, i, p), 0) for p in ("backward_input", "backward_weight")]
            if seen.get(Action(c, i, "forward"), 0) != 1 or (whole, split) not in (
                (1, [0, 0]),
                (0, [1, 1]),
            ):
                raise ScheduleOrderError(
                    f"the orders do not run chunk {c}'s micro-batch {i} forward once and "
                    "backward once (whole, or input then weight gradient)"
                )


def _detach_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        if value.requires_grad:
            leaf.requires_grad_(True)
        return leaf
    return value


def _backward_action(
    stage: Stage, action: Action, saved: _Saved, recorder: TimelineRecorder
) -> list[Any] | None:
    """Run ``action``'s backward on ``saved``; the gradients of the chunk's input leaves
    (None each where none) for the input phases, None for the weight phase."""
    c, i, phase = action
    outputs = saved.outputs
    grads = saved.grads if saved.grads is not None else [torch.ones_like(t) for t in outputs]
    with recorder.record(c, i, phase, stage.device):
        if phase == "backward_input":
            wanted = [x for x in saved.leaves if isinstance(x, torch.Tensor) and x.requires_grad]
            found = (
                torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
                if outputs and wanted
                else [None] * len(wanted)
            )
            by_id = {id(x): g for x, g in zip(wanted, found, strict=True)}
            return [by_id.get(id(x)) for x in saved.leaves]
        if outputs:
            # The parameters' gradients accumulate into ``.grad`` (and the input leaves'
            # into theirs: what the previous chunk receives after a whole backward).
            torch.autograd.backward(outputs, grads)
    if phase == "backward_weight":
        return None
    return [
        x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in saved.leaves
    ]


def run_actions(
    stages: Sequence[Stage],
    microbatches: Sequence[Sequence[Any]],
    orders: Sequence[Sequence[Action]],
    *,
    checkpoint: Callable[[int, int], bool],
    recorder: TimelineRecorder,
    rng: MicrobatchRNG | None,
    loss_of: Callable[[int, tuple[Any, ...]], Any] | None = None,
    saving: Callable[[], AbstractContextManager[None]] = nullcontext,
) -> ActionRun:
    """Run forward and backward of every micro-batch through ``stages`` (the K x V chunks in
    model order) in each rank's own order: ``orders[r]`` lists rank ``r``'s actions
    (``Action(chunk, micro-batch, phase)``, phase ``forward``, ``backward``,
    ``backward_input`` or ``backward_weight``), as a plan's ``actions``
    hold them for any of the seven schedules.

    Each round, every rank whose next action has its inputs (the previous chunk's forward
    output; the next chunk's input gradient; its own input gradient for a weight action)
    runs it, ranks on different devices at once on their workers (``worker.py``); a rank
    never runs ahead of its order, so the executed order of each rank is ``orders[r]``.
    The last chunk's forward output of micro-batch ``i`` goes to ``loss_of(i, outputs)``,
    which returns an object with a scalar ``total`` (a ``LossTerm``); its backward starts
    from ``total`` with gradient 1 (the caller scales: the terms' counts are known only at
    the end). ``backward`` is the chunk's whole backward, ``backward_input`` the gradient
    of its inputs only (the graph is kept), ``backward_weight`` then the parameter
    gradients (one more backward over the kept graph: the split costs time here, not
    correctness). ``saving()`` is entered around every forward (an ActivationMeter's).
    Raises :class:`ScheduleOrderError` naming the stuck actions when no rank can go on.
    Cost: one round per action of the longest rank at best; O(total actions x K).
    """
    single_device = len({str(stage.device) for stage in stages}) == 1
    workers: list[Worker | InlineWorker] = (
        [InlineWorker()] * len(stages)
        if single_device
        else [worker_for(stage.device) for stage in stages]
    )
    _check_orders(orders, len(stages), len(microbatches))
    state = _ActionState(len(stages), microbatches)
    terms: list[Any] = [None] * len(microbatches)
    position = [0] * len(orders)
    executed: list[list[Action]] = [[] for _ in orders]
    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        due = [
            (r, orders[r][position[r]])
            for r in range(len(orders))
            if position[r] < len(orders[r]) and state.ready(orders[r][position[r]])
        ]
        if not due:
            stuck = ", ".join(
                f"rank {r} at {orders[r][position[r]]}"
                for r in range(len(orders))
                if position[r] < len(orders[r])
            )
            raise ScheduleOrderError(f"the rank orders cannot go on: {stuck} wait for inputs")
        by_worker: dict[Worker | InlineWorker, list[tuple[int, Callable[[], Any]]]] = {}
        for r, action in due:
            stage = stages[action.stage]
            if action.phase == "forward":
                key = (action.stage, action.microbatch)
                inputs = (state.inputs.pop(key), state.specs.pop(key))
                task: Callable[[], Any] = partial(
                    _forward_action, stage, action, inputs, action.stage == state.last,
                    checkpoint(action.microbatch, action.stage), recorder, rng, loss_of, saving,
                )  # fmt: skip
            else:
                saved = state.saved[(action.stage, action.microbatch)]
                task = partial(_backward_action, stage, action, saved, recorder)
            by_worker.setdefault(workers[action.stage], []).append((r, task))
        futures = [worker.submit(partial(_run_all, tasks)) for worker, tasks in by_worker.items()]
        wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        results = {r: out for future in futures for r, out in future.result()}
        for r, action in due:
            _apply(state, action, results[r], terms)
            executed[r].append(action)
            position[r] += 1
    return ActionRun(terms, executed)


def _apply(state: _ActionState, action: Action, result: Any, terms: list[Any]) -> None:
    """Keep what ``action`` produced for the actions that wait for it."""
    c, i, phase = action
    state.done.add(action)
    if phase == "forward":
        passed, spec, saved, term = result
        state.saved[(c, i)] = saved
        if c == state.last:
            terms[i] = term
        else:
            state.inputs[(c + 1, i)], state.specs[(c + 1, i)] = passed, spec
        return
    if phase != "backward_input":
        del state.saved[(c, i)]  # frees the chunk's activations
    if result is None or c == 0:
        return
    # Chunk c's input leaves are chunk c - 1's flat outputs: its roots sit at ``positions``.
    before = state.saved[(c - 1, i)]
    pairs = [
        (out, result[p])
        for out, p in zip(before.outputs, before.positions, strict=True)
        if result[p] is not None
    ]
    before.outputs = [out for out, _ in pairs]
    before.grads = [g.to(out.device) for out, g in pairs]
