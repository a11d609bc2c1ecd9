"""Measure a plan's training steps with the executor: the torch side of ``autopipe bench``.

``measure_steps`` trains ``warmup + steps`` SGD steps of a plan with ``build_pipeline`` and keeps,
per measured step, the executor's Timeline on the wall clock (CUDA events on a GPU) and on
the comparison clock, with the loss forward and backward recorded as ``loss`` tasks of the
last stage (the executor computes the loss once, on the gathered output). The clocks are
handed to the pipeline (``pipe.timeline_clocks``); nothing is patched. The comparison with
the plan is ``autopipe.bench_report.compare``, which needs no torch.

Clocks: ``"wall"`` reads everything on the wall clock. ``"thread_cpu"`` reads each task on
``time.thread_time`` (the CPU seconds of the thread running it: on CPU a task runs wholly
on one thread, the device's worker in forward, the autograd thread in backward) and the
iteration as the process's CPU seconds (``time.process_time``: every thread that works for
the step counts), so other processes on a shared host do not inflate them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from autopipe.profiler.measure import profile
from autopipe.profiler.options import MeasureOptions
from autopipe.profiler.tree import float_tensor_leaves
from autopipe.profiler.units import trace_units
from autopipe.runtime.parallelize import build_pipeline
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.recorder import Clock, TimelineRecorder
from torch import nn
from tqdm import tqdm

from autopipe.core.plan import Plan, StagePlan
from autopipe.core.timeline import Action, Timeline

__all__ = [
    "CLOCKS",
    "Measurement",
    "StepMeasurement",
    "calibrate_executor_overhead",
    "choose_clock",
    "clocks_for",
    "measure_steps",
]

CLOCKS = ("auto", "wall", "thread_cpu")


def choose_clock(clock: str, devices: Sequence[str], threads: int) -> str:
    """``auto`` -> ``thread_cpu`` when every stage is on the CPU and torch runs one thread
    (what the profiler measures by default there), else ``wall``."""
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {', '.join(CLOCKS)}")
    if clock != "auto":
        return clock
    all_cpu = bool(devices) and all(str(d).startswith("cpu") for d in devices)
    return "thread_cpu" if all_cpu and threads == 1 else "wall"


def clocks_for(clock: str) -> dict[str, Clock | None]:
    """The recorder clocks for comparison clock ``clock``: always ``"wall"`` (the default
    device clock, for the drawn timeline), plus ``"thread_cpu"`` when asked for."""
    clocks: dict[str, Clock | None] = {"wall": None}
    if clock == "thread_cpu":
        clocks["thread_cpu"] = time.thread_time
    return clocks


@dataclass
class StepMeasurement:
    """One measured training step."""

    timeline: Timeline
    """The step's tasks on the wall clock, the first starting at 0 s; the loss forward and
    backward are ``loss`` tasks (micro-batch -1) of the last stage."""
    task_timeline: Timeline
    """The same tasks on the comparison clock (``timeline`` itself for ``"wall"``; for
    ``"thread_cpu"`` durations are CPU seconds and starts compare only within a thread)."""
    iteration_s: float
    """The iteration on the comparison clock: the wall makespan (first forward start to last
    backward end), or the process CPU seconds from the pipeline's forward to the end of
    ``loss.backward()``."""
    step_wall_s: float
    """Wall seconds of the whole step (forward, loss, backward, optimizer)."""

    def loss_s(self) -> tuple[float, float]:
        """Seconds of the loss forward and the loss backward on the comparison clock."""
        loss = sorted(self.task_timeline.of("loss"), key=lambda t: t.start_s)
        durations = [t.duration_s for t in loss] + [0.0, 0.0]
        return durations[0], durations[1]


@dataclass
class Measurement:
    """What ``measure_steps`` saw: the stages' devices, the clock and each measured step."""

    devices: list[str]
    clock: str
    """``"wall"`` or ``"thread_cpu"``: the comparison clock (``auto`` resolved)."""
    steps: list[StepMeasurement] = field(default_factory=list)


def measure_steps(
    model: Any,
    example_inputs: Any,
    plan: Plan,
    *,
    devices: Sequence[Any] | None = None,
    steps: int = 5,
    warmup: int = 1,
    loss_fn: Callable[[Any, Any], Any] | None = None,
    lr: float = 1e-3,
    clock: str = "auto",
    progress: bool = False,
    orders: Sequence[Sequence[Action]] | None = None,
) -> Measurement:
    """Train ``warmup + steps`` SGD steps of ``plan``; measure the last ``steps``.

    ``orders``: each rank's actions of the plan's schedule (needed for any schedule but
    GPipe: ``plan.actions``); a non-GPipe plan trains with
    ``Pipeline.step`` in that order, its loss inside the last stage's forward and backward.

    ``example_inputs`` is one mini-batch of ``plan.batch_size`` samples; ``devices`` default
    to the executor's choice (K CUDA devices, else K x "cpu"); ``clock`` as in
    :func:`choose_clock`. Cost: ``warmup + steps`` training steps.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    pipe = build_pipeline(model, example_inputs, plan, devices, orders=orders)
    pipe.train()
    # One device per rank: chunk r < K is on rank r under every placement.
    stage_devices = [str(d) for d in getattr(pipe, "devices", devices or [])][: plan.num_stages]
    clock = choose_clock(clock, stage_devices, torch.get_num_threads())
    pipe.timeline_clocks = clocks_for(clock)
    # The iteration on the thread-CPU clock is the process's CPU time.
    iteration_clock = time.perf_counter if clock == "wall" else time.process_time
    loss_device = pipe.devices[-1]
    last = plan.num_stages - 1
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
    measurement = Measurement(stage_devices, clock)
    bar = tqdm(
        total=warmup + steps,
        desc=f"bench {plan.num_stages} stages x M={plan.microbatches}",
        unit="step",
        disable=not progress,
    )
    for step in range(warmup + steps):
        recorder, clock_s, wall_s = _train_step(
            pipe, optimizer, example_inputs, loss_fn, iteration_clock, last, loss_device
        )
        bar.update()
        if step < warmup:
            continue
        wall = recorder.timeline("wall").shifted()
        on_clock = wall if clock == "wall" else recorder.timeline(clock)
        measurement.steps.append(
            StepMeasurement(
                timeline=wall,
                task_timeline=on_clock,
                iteration_s=wall.iteration_s if clock == "wall" else clock_s,
                step_wall_s=wall_s,
            )
        )
    bar.close()
    return measurement


def _train_step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], Any] | None,
    iteration_clock: Callable[[], float],
    last: int,
    loss_device: Any,
) -> tuple[TimelineRecorder, float, float]:
    """One SGD step of ``pipe``, the loss's backward recorded on the last stage; returns
    the step's recorder, its seconds on ``iteration_clock`` (to the end of backward) and
    its wall seconds (to the end of the optimizer step)."""
    optimizer.zero_grad(set_to_none=True)
    w0, c0 = time.perf_counter(), iteration_clock()
    if pipe.schedule != "gpipe":  # the plan's own order (pipe(x) + backward would be GPipe)
        pipe.step(example_inputs, loss_fn=loss_fn)
        c1 = iteration_clock()
        assert pipe.last_recorder is not None
        optimizer.step()
        return pipe.last_recorder, c1 - c0, time.perf_counter() - w0
    outputs = pipe.run_microbatches(example_inputs)
    recorder = pipe.last_recorder
    assert recorder is not None  # every run of the pipeline records
    # The objective micro-batch by micro-batch, as torchrun computes it; the plan's
    # last stage includes its time.
    loss = pipe.microbatch_loss(outputs, example_inputs, loss_fn=loss_fn)
    head = next((t for t in float_tensor_leaves(outputs[-1]) if t.requires_grad), None)
    loss_backward = recorder.begin(last, -1, "loss", loss_device)
    handle = None
    if head is not None:
        # Fires (on the autograd thread) once d loss / d output exists.
        handle = head.register_hook(lambda grad, span=loss_backward, rec=recorder: rec.end(span))
    loss.backward()
    c1 = iteration_clock()
    if handle is not None:
        handle.remove()
    optimizer.step()
    w1 = time.perf_counter()
    return recorder, c1 - c0, w1 - w0


def calibrate_executor_overhead(
    devices: Sequence[str], microbatches: int = 8, steps: int = 12
) -> tuple[float, float]:
    """Thread-CPU seconds the executor adds to each forward and each backward task.

    The profiler times units on their own; the executor wraps every (stage, micro-batch)
    task in a thread hand-off, an autograd node and, in backward, its own
    ``torch.autograd.backward`` call. This runs a pipeline of ``len(devices)`` one-weight
    ``Linear(1, 1)`` stages (whose own cost is profiled too) and returns the median task
    time minus the profiled unit time, forward and backward, floored at 0. CPU only.
    About a second.
    """
    k = len(devices)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(k)])
    x = torch.randn(microbatches, 1)
    names = trace_units(model, x).unit_names
    prof = profile(model, x, MeasureOptions(microbatch_sizes=(1,)), progress=False)
    unit_f = statistics.median(u.forward_at(1, microbatches) for u in prof.units)
    unit_b = statistics.median(u.backward_at(1, microbatches) for u in prof.units)
    tiny = Plan(
        num_stages=k,
        microbatches=microbatches,
        microbatch_size=1,
        batch_size=microbatches,
        stages=[
            StagePlan(index=i, device=str(d), units=[n])
            for i, (d, n) in enumerate(zip(devices, names, strict=True))
        ],
    )
    pipe = build_pipeline(model, x, tiny, list(devices))
    pipe.timeline_clocks = clocks_for("thread_cpu")
    fwd: list[float] = []
    bwd: list[float] = []
    for step in range(steps):
        pipe(x).sum().backward()
        if step >= 2:  # warm-up
            recorder = pipe.last_recorder
            assert recorder is not None  # every run of the pipeline records
            on_cpu = recorder.timeline("thread_cpu")
            fwd += [t.duration_s for t in on_cpu.of("forward")]
            bwd += [t.duration_s for t in on_cpu.of("backward")]
    return (
        max(statistics.median(fwd) - unit_f, 0.0),
        max(statistics.median(bwd) - unit_b, 0.0),
    )
