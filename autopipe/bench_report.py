"""Compare what the cost model predicted for a plan with what the executor measured.

``run_bench(model, example_inputs, plan)`` trains ``steps`` steps of ``plan`` with
``autopipe.parallelize`` on the local devices (the measuring is
``autopipe.runtime.step_measurement.measure_steps``: each step's Timeline, on the clocks it hands the
pipeline) and compares them (:func:`compare`, pure and torch-free, as is this module's
import) with a *prediction of the same placement*: the
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from autopipe.core.humanize import format_seconds
from autopipe.core.plan import Plan
from autopipe.core.timeline import Timeline
from autopipe.viz.gantt import timeline_detail, timeline_title
from autopipe.viz.predict import predicted_timeline

if TYPE_CHECKING:
    from autopipe.runtime.step_measurement import Measurement


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

    def compare_titles(self) -> tuple[str, str]:
        """Titles of the predicted-over-measured figure that compare like with like: the
        measured panel states the iteration on the clock the prediction is judged on
        (:attr:`clock`: process CPU time, or wall), as a median over the steps with its
        error, and then the wall time of the step it draws. Before, it showed only the
        drawn step's wall time (4.95 s) against a 2.2 s prediction that the text, on
        thread-CPU time, found 0.4% off."""
        clock = "CPU time" if self.clock == "thread_cpu" else "wall clock"
        err = 100 * self.iteration_error
        measured = (
            f"measured ({timeline_detail(self.measured)}): iteration "
            f"{format_seconds(self.iteration_measured_s)} {clock} (median of {self.steps} "
            f"steps; predicted {err:+.1f}%)"
        )
        if self.clock == "thread_cpu":
            measured += f"; drawn on the wall clock: {format_seconds(self.measured.iteration_s)}"
        return timeline_title(self.predicted), measured

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

    The backward duration includes a nested recomputation (the executor runs it inside); a
    stage whose backward ran split (zero-bubble orders) counts its input- plus weight-gradient
    medians.
    Works on a timeline of any clock, a per-thread one included (only durations are read).
    """
    out = []
    for s in range(timeline.num_stages):
        fwd = timeline.durations(s, "forward")
        bwd = timeline.durations(s, "backward")
        back = statistics.median(bwd) if bwd else 0.0
        for split in ("backward_input", "backward_weight"):  # zero-bubble: B and W apart
            part = timeline.durations(s, split) if not bwd else []
            back += statistics.median(part) if part else 0.0
        out.append((statistics.median(fwd) if fwd else 0.0, back))
    return out


def with_overhead(plan: Plan, forward_s: float, backward_s: float) -> Plan:
    """A copy of ``plan`` whose stages each take ``forward_s``/``backward_s`` longer per task."""
    out = Plan.from_dict(plan.to_dict())
    for st in out.stages:
        st.forward_s += forward_s
        st.backward_s += backward_s
    return out


def compare(
    plan: Plan,
    measurement: Measurement,
    *,
    executor_overhead_s: tuple[float, float] = (0.0, 0.0),
) -> BenchResult:
    """Predicted vs measured for ``plan``: pure, torch-free, O(steps x tasks + simulation).

    The prediction simulates ``plan`` with ``executor_overhead_s`` (seconds per forward and
    per backward task) added to every stage, on the measured placement (stages on one
    device share it). Measured figures are medians over the steps of ``measurement``; the
    loss, which the executor runs once outside the stages, is added to the last stage as its
    forward and backward divided by M (see the module docstring).
    """
    runs = measurement.steps
    if not runs:
        raise ValueError("nothing to compare: the measurement has no steps")
    predicted_plan = with_overhead(plan, *executor_overhead_s)
    predicted = predicted_timeline(predicted_plan, devices=measurement.devices or None)
    per_step = [measured_stage_times(run.task_timeline) for run in runs]
    loss = [run.loss_s() for run in runs]
    loss_f = statistics.median(f for f, _ in loss)
    loss_b = statistics.median(b for _, b in loss)
    k, m = plan.num_stages, plan.microbatches
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
                device=measurement.devices[s] if s < len(measurement.devices) else "",
                forward_predicted_s=st.forward_s,
                forward_measured_s=fwd,
                backward_predicted_s=st.backward_s + st.recompute_s,
                backward_measured_s=bwd,
            )
        )
    # The last step's run, drawn under the prediction; a copy, the measurement stays as is.
    measured = replace(runs[-1].timeline, schedule=plan.schedule, label="measured (wall clock)")
    iterations = [run.iteration_s for run in runs]
    return BenchResult(
        plan=plan,
        devices=measurement.devices,
        steps=len(runs),
        clock=measurement.clock,
        predicted=predicted,
        measured=measured,
        stages=stages,
        iteration_predicted_s=predicted.iteration_s,
        iteration_measured_s=statistics.median(iterations),
        iteration_wall_s=statistics.median(run.timeline.iteration_s for run in runs),
        step_measured_s=statistics.median(run.step_wall_s for run in runs),
        loss_forward_s=loss_f,
        loss_backward_s=loss_b,
        iteration_samples_s=iterations,
        executor_overhead_s=executor_overhead_s,
    )


def choose_clock(clock: str, devices: Sequence[str], threads: int) -> str:
    """The measuring side's :func:`autopipe.runtime.step_measurement.choose_clock` (imports torch)."""
    from autopipe.runtime.step_measurement import choose_clock as choose

    return choose(clock, devices, threads)


def calibrate_executor_overhead(
    devices: Sequence[str], microbatches: int = 8, steps: int = 12
) -> tuple[float, float]:
    """The measuring side's :func:`autopipe.runtime.step_measurement.calibrate_executor_overhead`."""
    from autopipe.runtime.step_measurement import calibrate_executor_overhead as calibrate

    return calibrate(devices, microbatches=microbatches, steps=steps)


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
    stages, not on this run) to every stage of the prediction. Cost: ``warmup + steps``
    training steps plus one simulation. Measures with ``autopipe.runtime.step_measurement.measure_steps``
    in the plan's own per-rank order (``plan.actions``), then
    :func:`compare`.
    """
    from autopipe.runtime.parallelize import stage_devices
    from autopipe.runtime.step_measurement import calibrate_executor_overhead as calibrate
    from autopipe.runtime.step_measurement import measure_steps

    placed = [str(d) for d in stage_devices(devices, None, plan)]
    if plan.virtual_stages > 1 and len(set(placed)) < len(placed):
        # Refused before training: the prediction could not be made afterwards.
        raise ValueError(
            f"bench predicts {plan.schedule} with {plan.virtual_stages} chunks per rank on "
            f"dedicated devices only, but the ranks share {placed[0]}: bench it on "
            f"{plan.num_stages} distinct devices (--devices), or train it with "
            "autopipe.parallelize(...).step"
        )
    measurement = measure_steps(
        model,
        example_inputs,
        plan,
        devices=devices,
        steps=steps,
        warmup=warmup,
        loss_fn=loss_fn,
        lr=lr,
        clock=clock,
        progress=progress,
        orders=plan.actions,
    )
    overhead = (0.0, 0.0)
    if executor_overhead and measurement.clock == "thread_cpu":
        overhead = calibrate(measurement.devices, microbatches=plan.microbatches)
    return compare(plan, measurement, executor_overhead_s=overhead)
