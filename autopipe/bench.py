"""Run a plan with the executor and compare what the cost model predicted with what ran.

``run_bench(model, example_inputs, plan)`` trains ``steps`` steps of ``plan`` with
``autopipe.parallelize`` on the local devices, keeps each step's measured timeline
(``pipeline.last_timeline``) and compares it with a *prediction of the same placement*: the
plan's per-stage costs simulated with the stages that share a physical device (e.g. four
"devices" that are all this machine's CPU: one executor worker thread and one autograd thread
run all of them) list-scheduled on that one device, as ``autopipe.planner.simulate`` does for
``shared_device_groups``.

What is compared (medians over the measured steps; per step, medians over micro-batches):
- per stage, forward seconds per micro-batch: plan ``forward_s`` vs the executor's forward task;
- per stage, backward seconds per micro-batch: plan ``backward_s + recompute_s`` vs the
  executor's backward task (its recomputation runs nested inside it);
- iteration seconds: the simulated makespan vs the measured one (first forward start to last
  backward end; the optimizer step is reported separately).
Clocks: on a CPU shared with other processes, wall times include their time, while the
profiler (single-threaded on CPU by default) reads each thread's CPU time. ``clock="auto"``
compares like with like: with every stage on the CPU and one torch thread, tasks are read on
the thread-CPU clock and the iteration as the process's CPU seconds (on one shared CPU every
task runs one after another, so that is the iteration's length on an otherwise idle host);
otherwise everything is wall clock. The wall makespan is always reported too.
The executor adds a fixed cost to every task (thread hand-off, autograd node, a separate
``torch.autograd.backward`` per stage) that per-unit profiling does not see; on the thread-CPU
clock it is calibrated on a pipeline of tiny stages (not on the run being judged) and added to
each stage of the prediction. It matters only for stages of a few tenths of a millisecond.
The profiler charges the loss to the last unit, so the plan's last stage includes it; the
executor computes the loss once on the gathered output, outside any stage task. The measured
last stage therefore gets the measured loss forward and loss backward divided by M added, so
both sides count the same work (the iteration makespan contains the loss on both sides).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from autopipe.planner.plan import Plan
from autopipe.viz.timeline import Timeline, as_timeline


@dataclass
class StageComparison:
    """Predicted vs measured seconds per micro-batch of one stage."""

    stage: int
    device: str
    forward_predicted_s: float
    forward_measured_s: float
    backward_predicted_s: float
    backward_measured_s: float

    @property
    def forward_error(self) -> float:
        """(predicted - measured) / measured, a fraction (0.1 = predicted 10% too slow)."""
        return _error(self.forward_predicted_s, self.forward_measured_s)

    @property
    def backward_error(self) -> float:
        return _error(self.backward_predicted_s, self.backward_measured_s)


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured > 0 else float("inf")


@dataclass
class BenchResult:
    """Everything ``autopipe bench`` prints and writes."""

    plan: Plan
    devices: list[str]
    steps: int
    clock: str
    """``"wall"`` or ``"thread_cpu"``: the clock the measured figures are read from."""
    predicted: Timeline
    """Simulated iteration of the plan on ``devices`` (shared devices list-scheduled)."""
    measured: Timeline
    """The last measured step's timeline."""
    stages: list[StageComparison]
    iteration_predicted_s: float
    iteration_measured_s: float
    """Median over steps of the measured iteration on ``clock``: the wall makespan (first
    forward start to last backward end), or the process CPU seconds from the pipeline's
    forward to the end of ``loss.backward()``."""
    iteration_wall_s: float
    """Median wall makespan, whatever the clock (on a loaded host it includes others' time)."""
    step_measured_s: float
    """Median wall seconds of a whole training step (forward, loss, backward, optimizer)."""
    loss_forward_s: float
    loss_backward_s: float
    """Median seconds of the loss forward and backward on the gathered mini-batch."""
    iteration_samples_s: list[float] = field(default_factory=list)
    executor_overhead_s: tuple[float, float] = (0.0, 0.0)
    """Executor cost per forward and per backward task added to the prediction (seconds)."""

    @property
    def iteration_error(self) -> float:
        return _error(self.iteration_predicted_s, self.iteration_measured_s)

    @property
    def max_stage_error(self) -> float:
        """Largest |error| over every stage's forward and backward."""
        return max(
            (abs(e) for s in self.stages for e in (s.forward_error, s.backward_error)),
            default=0.0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.plan.model,
            "num_stages": self.plan.num_stages,
            "microbatches": self.plan.microbatches,
            "batch_size": self.plan.batch_size,
            "schedule": self.plan.schedule,
            "devices": self.devices,
            "shared_device_groups": self.predicted.device_groups(),
            "steps": self.steps,
            "clock": self.clock,
            "iteration_predicted_s": self.iteration_predicted_s,
            "iteration_measured_s": self.iteration_measured_s,
            "iteration_error": self.iteration_error,
            "iteration_measured_samples_s": self.iteration_samples_s,
            "iteration_wall_s": self.iteration_wall_s,
            "step_measured_s": self.step_measured_s,
            "loss_forward_s": self.loss_forward_s,
            "loss_backward_s": self.loss_backward_s,
            "plan_iteration_time_s": self.plan.iteration_time_s,
            "executor_overhead_forward_s": self.executor_overhead_s[0],
            "executor_overhead_backward_s": self.executor_overhead_s[1],
            "max_stage_error": self.max_stage_error,
            "stages": [
                {
                    "stage": s.stage,
                    "device": s.device,
                    "forward_predicted_s": s.forward_predicted_s,
                    "forward_measured_s": s.forward_measured_s,
                    "forward_error": s.forward_error,
                    "backward_predicted_s": s.backward_predicted_s,
                    "backward_measured_s": s.backward_measured_s,
                    "backward_error": s.backward_error,
                }
                for s in self.stages
            ],
        }


def measured_stage_times(timeline: Timeline) -> list[tuple[float, float]]:
    """Per stage ``(forward_s, backward_s)``: medians of its task durations over micro-batches.

    The backward duration includes a nested recomputation (the executor runs it inside).
    """
    out = []
    for s in range(timeline.num_stages):
        fwd = timeline.durations(s, "forward")
        bwd = timeline.durations(s, "backward")
        out.append((statistics.median(fwd) if fwd else 0.0, statistics.median(bwd) if bwd else 0.0))
    return out


CLOCKS = ("auto", "wall", "thread_cpu")


def _measured_timeline(
    runtime_timeline: Any,
    loss_spans: list[tuple[float, float]],
    num_stages: int,
    devices: Sequence[str],
) -> Timeline:
    """The executor's task records plus the loss forward/backward (``perf_counter`` spans)
    as ``loss`` tasks on the last stage's row, so the gap they fill is not read as idle."""
    records: list[Any] = list(getattr(runtime_timeline, "records", runtime_timeline))
    origin_s = float(getattr(runtime_timeline, "origin_s", 0.0))
    device = devices[-1] if devices else None
    for start, end in loss_spans:
        records.append(
            {
                "stage": num_stages - 1,
                "microbatch": -1,
                "phase": "loss",
                "start_s": start - origin_s,
                "end_s": end - origin_s,
                **({"device": device} if device is not None else {}),
            }
        )
    return as_timeline(records, num_stages=num_stages, label="measured")


@contextmanager
def _task_cpu_times() -> Iterator[dict[tuple[int, int, str], float]]:
    """Thread CPU seconds of every executor task while active, keyed (stage, mb, phase).

    The executor's timeline stamps tasks with the wall clock only; on a shared host that
    counts time other processes take. Pipelines built inside this context get a timeline
    whose ``record`` also reads ``time.thread_time`` on the thread that runs the task (on
    CPU a task runs wholly on one thread: the device's worker in forward, the autograd
    thread in backward; a recomputation nests in its backward, as in the wall times).
    Restores the executor's timeline class on exit.
    """
    import autopipe.runtime.pipeline as runtime_pipeline

    base = runtime_pipeline.Timeline
    stamps: dict[tuple[int, int, str], float] = {}

    class CpuStampedTimeline(base):  # type: ignore[misc, valid-type]
        @contextmanager
        def record(self, stage: int, microbatch: int, phase: str, device: Any) -> Iterator[None]:
            start = time.thread_time()
            try:
                with super().record(stage, microbatch, phase, device):
                    yield
            finally:
                stamps[(stage, microbatch, phase)] = time.thread_time() - start

    runtime_pipeline.Timeline = CpuStampedTimeline
    try:
        yield stamps
    finally:
        runtime_pipeline.Timeline = base


def _cpu_stage_times(
    stamps: dict[tuple[int, int, str], float], num_stages: int
) -> list[tuple[float, float]]:
    """Per stage ``(forward_s, backward_s)`` medians over micro-batches of thread CPU time."""
    out = []
    for s in range(num_stages):
        fwd = [v for (st, _, ph), v in stamps.items() if st == s and ph == "forward"]
        bwd = [v for (st, _, ph), v in stamps.items() if st == s and ph == "backward"]
        out.append((statistics.median(fwd) if fwd else 0.0, statistics.median(bwd) if bwd else 0.0))
    return out


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
    import torch
    from torch import nn

    import autopipe
    from autopipe.planner.plan import StagePlan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.units import trace_units

    k = len(devices)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(k)])
    x = torch.randn(microbatches, 1)
    names = trace_units(model, x).unit_names
    prof = profile(model, x, progress=False, microbatch_sizes=(1,))
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
    fwd: list[float] = []
    bwd: list[float] = []
    with _task_cpu_times() as stamps:
        pipe = autopipe.parallelize(model, x, devices=list(devices), plan=tiny)
        for step in range(steps):
            stamps.clear()
            pipe(x).sum().backward()
            if step >= 2:  # warm-up
                fwd += [v for (_, _, ph), v in stamps.items() if ph == "forward"]
                bwd += [v for (_, _, ph), v in stamps.items() if ph == "backward"]
    return (
        max(statistics.median(fwd) - unit_f, 0.0),
        max(statistics.median(bwd) - unit_b, 0.0),
    )


def with_overhead(plan: Plan, forward_s: float, backward_s: float) -> Plan:
    """A copy of ``plan`` whose stages each take ``forward_s``/``backward_s`` longer per task."""
    out = Plan.from_dict(plan.to_dict())
    for st in out.stages:
        st.forward_s += forward_s
        st.backward_s += backward_s
    return out


def choose_clock(clock: str, devices: Sequence[str], threads: int) -> str:
    """``auto`` -> ``thread_cpu`` when every stage is on the CPU and torch runs one thread
    (what the profiler measures by default there), else ``wall``."""
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {', '.join(CLOCKS)}")
    if clock != "auto":
        return clock
    all_cpu = bool(devices) and all(str(d).startswith("cpu") for d in devices)
    return "thread_cpu" if all_cpu and threads == 1 else "wall"


def run_bench(
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
    executor_overhead: bool = True,
    progress: bool = False,
) -> BenchResult:
    """Train ``warmup + steps`` SGD steps of ``plan``; compare the last ``steps`` with the plan.

    ``example_inputs`` is one mini-batch of ``plan.batch_size`` samples; ``devices`` default
    to the executor's choice (K CUDA devices, else K x "cpu"). ``clock``: what measured
    times are read from: ``"wall"``, ``"thread_cpu"`` (CPU seconds of the thread running each
    task, and of the whole process for the iteration: unaffected by other processes on a
    shared host; use with one torch thread, as the profiler does by default on CPU) or
    ``"auto"`` (see :func:`choose_clock`). ``executor_overhead``: on the thread-CPU clock,
    add the executor's per-task cost (:func:`calibrate_executor_overhead`, measured on tiny
    stages, not on this run) to every stage of the prediction. Cost: ``warmup + steps`` training steps plus one
    simulation.
    """
    import torch
    from tqdm import tqdm

    import autopipe
    from autopipe.profiler.measure import loss_of
    from autopipe.profiler.trace import call_model
    from autopipe.profiler.tree import float_tensor_leaves
    from autopipe.viz.predict import predicted_timeline

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    with _task_cpu_times() as stamps:
        pipe = autopipe.parallelize(model, example_inputs, devices=devices, plan=plan)
        pipe.train()
        stage_devices = [str(d) for d in getattr(pipe, "devices", devices or [])]
        clock = choose_clock(clock, stage_devices, torch.get_num_threads())
        # The iteration on the thread-CPU clock is the process's CPU time: every thread
        # that works for the step (the stages' workers, the autograd thread) counts.
        now = time.perf_counter if clock == "wall" else time.process_time
        loss_now = time.perf_counter if clock == "wall" else time.thread_time
        optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
        timelines: list[Timeline] = []
        per_step: list[list[tuple[float, float]]] = []
        walls, iterations, loss_fwd, loss_bwd = [], [], [], []
        # One step per training step, and a last one for calibration and the prediction.
        bar = tqdm(
            total=warmup + steps + 1,
            desc=f"bench {plan.num_stages} stages x M={plan.microbatches}",
            unit="step",
            disable=not progress,
        )
        for step in range(warmup + steps):
            optimizer.zero_grad(set_to_none=True)
            stamps.clear()
            w0, c0 = time.perf_counter(), now()
            output = call_model(pipe, example_inputs)
            l0, lw0 = loss_now(), time.perf_counter()
            # The profiler's loss (its stand-in too): the plan's last stage includes it.
            loss = loss_of(output, example_inputs, loss_fn)
            l1, lw1 = loss_now(), time.perf_counter()
            grad_of_output: list[tuple[float, float]] = []
            head = next((t for t in float_tensor_leaves(output) if t.requires_grad), None)
            handle = None
            if head is not None:
                # Fires (on the autograd thread) once d loss / d output exists.
                handle = head.register_hook(
                    lambda g, out=grad_of_output: out.append((loss_now(), time.perf_counter()))
                )
            l2, lw2 = loss_now(), time.perf_counter()
            loss.backward()
            c1 = now()
            if handle is not None:
                handle.remove()
            optimizer.step()
            w1 = time.perf_counter()
            bar.update()
            if step < warmup:
                continue
            loss_spans = [(lw0, lw1)] + ([(lw2, grad_of_output[0][1])] if grad_of_output else [])
            tl = _measured_timeline(pipe.last_timeline, loss_spans, plan.num_stages, stage_devices)
            timelines.append(tl)
            per_step.append(
                measured_stage_times(tl)
                if clock == "wall"
                else _cpu_stage_times(stamps, plan.num_stages)
            )
            walls.append(w1 - w0)
            iterations.append(tl.iteration_s if clock == "wall" else c1 - c0)
            loss_fwd.append(l1 - l0)
            loss_bwd.append((grad_of_output[0][0] - l2) if grad_of_output else 0.0)
    measured = timelines[-1]
    measured.schedule = plan.schedule
    measured.label = "measured (wall clock)"
    overhead = (0.0, 0.0)
    if executor_overhead and clock == "thread_cpu":
        overhead = calibrate_executor_overhead(stage_devices, microbatches=plan.microbatches)
    predicted_plan = with_overhead(plan, *overhead)
    predicted = predicted_timeline(predicted_plan, devices=stage_devices or None)
    bar.update()
    bar.close()
    k, m = plan.num_stages, plan.microbatches
    loss_f, loss_b = statistics.median(loss_fwd), statistics.median(loss_bwd)
    stages = []
    for s, st in enumerate(predicted_plan.stages):
        fwd = statistics.median(x[s][0] for x in per_step)
        bwd = statistics.median(x[s][1] for x in per_step)
        if s == k - 1:  # the plan's last stage includes the loss (see the module docstring)
            fwd += loss_f / m
            bwd += loss_b / m
        stages.append(
            StageComparison(
                stage=s,
                device=stage_devices[s] if s < len(stage_devices) else "",
                forward_predicted_s=st.forward_s,
                forward_measured_s=fwd,
                backward_predicted_s=st.backward_s + st.recompute_s,
                backward_measured_s=bwd,
            )
        )
    return BenchResult(
        plan=plan,
        devices=stage_devices,
        steps=steps,
        clock=clock,
        predicted=predicted,
        measured=measured,
        stages=stages,
        iteration_predicted_s=predicted.iteration_s,
        iteration_measured_s=statistics.median(iterations),
        iteration_wall_s=statistics.median(tl.iteration_s for tl in timelines),
        step_measured_s=statistics.median(walls),
        loss_forward_s=loss_f,
        loss_backward_s=loss_b,
        iteration_samples_s=iterations,
        executor_overhead_s=overhead,
    )
