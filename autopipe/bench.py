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
- iteration seconds: the simulated makespan vs the measured makespan (first forward start to
  last backward end; the optimizer step is reported separately).
The profiler charges the loss to the last unit, so the plan's last stage includes it; the
executor computes the loss once on the gathered output, outside any stage task. The measured
last stage therefore gets the measured loss forward and loss backward divided by M added, so
both sides count the same work (the iteration makespan contains the loss on both sides).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
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
    predicted: Timeline
    """Simulated iteration of the plan on ``devices`` (shared devices list-scheduled)."""
    measured: Timeline
    """The last measured step's timeline."""
    stages: list[StageComparison]
    iteration_predicted_s: float
    iteration_measured_s: float
    """Median over steps of the measured makespan (first forward start to last backward end)."""
    step_measured_s: float
    """Median wall seconds of a whole training step (forward, loss, backward, optimizer)."""
    loss_forward_s: float
    loss_backward_s: float
    """Median seconds of the loss forward and backward on the gathered mini-batch."""
    iteration_samples_s: list[float] = field(default_factory=list)

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
            "iteration_predicted_s": self.iteration_predicted_s,
            "iteration_measured_s": self.iteration_measured_s,
            "iteration_error": self.iteration_error,
            "iteration_measured_samples_s": self.iteration_samples_s,
            "step_measured_s": self.step_measured_s,
            "loss_forward_s": self.loss_forward_s,
            "loss_backward_s": self.loss_backward_s,
            "plan_iteration_time_s": self.plan.iteration_time_s,
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


def _default_loss(output: Any, inputs: Any) -> Any:
    """Mean of the floating-point outputs: drives backward for model files without a loss."""
    import torch

    tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError(
            "the model returns no floating-point tensor; define loss_fn(output, inputs)"
        )
    return sum(t.float().mean() for t in tensors)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [value]


def _first_tensor(value: Any) -> Any:
    import torch

    for t in _flatten(value):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _call(pipe: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return pipe(**inputs)
    if isinstance(inputs, tuple):
        return pipe(*inputs)
    return pipe(inputs)


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
    progress: bool = False,
) -> BenchResult:
    """Train ``warmup + steps`` SGD steps of ``plan``; compare the last ``steps`` with the plan.

    ``example_inputs`` is one mini-batch of ``plan.batch_size`` samples; ``devices`` default
    to the executor's choice (K CUDA devices, else K x "cpu"). Cost: ``warmup + steps``
    training steps plus one simulation.
    """
    import torch

    import autopipe
    from autopipe.viz.predict import predicted_timeline

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    pipe = autopipe.parallelize(model, example_inputs, devices=devices, plan=plan)
    pipe.train()
    stage_devices = [str(d) for d in getattr(pipe, "devices", devices or [])]
    loss_fn = loss_fn or _default_loss
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
    timelines: list[Timeline] = []
    walls, loss_fwd, loss_bwd = [], [], []
    it: Any = range(warmup + steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"bench {plan.num_stages} stages x M={plan.microbatches}", unit="step")
    for step in it:
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        output = _call(pipe, example_inputs)
        t1 = time.perf_counter()
        loss = loss_fn(output, example_inputs)
        t2 = time.perf_counter()
        grad_of_output: list[float] = []
        head = _first_tensor(output)
        handle = None
        if head is not None:
            # Fires once the loss's backward has produced d loss / d output.
            handle = head.register_hook(
                lambda g, out=grad_of_output: out.append(time.perf_counter())
            )
        t3 = time.perf_counter()
        loss.backward()
        if handle is not None:
            handle.remove()
        optimizer.step()
        t4 = time.perf_counter()
        if step < warmup:
            continue
        timelines.append(
            as_timeline(pipe.last_timeline, num_stages=plan.num_stages, label="measured")
        )
        walls.append(t4 - t0)
        loss_fwd.append(t2 - t1)
        loss_bwd.append((grad_of_output[0] - t3) if grad_of_output else 0.0)
    measured = timelines[-1]
    measured.schedule = plan.schedule
    predicted = predicted_timeline(plan, devices=stage_devices or None)
    k, m = plan.num_stages, plan.microbatches
    per_step = [measured_stage_times(tl) for tl in timelines]
    loss_f, loss_b = statistics.median(loss_fwd), statistics.median(loss_bwd)
    stages = []
    for s, st in enumerate(plan.stages):
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
    spans = [tl.iteration_s for tl in timelines]
    return BenchResult(
        plan=plan,
        devices=stage_devices,
        steps=steps,
        predicted=predicted,
        measured=measured,
        stages=stages,
        iteration_predicted_s=predicted.iteration_s,
        iteration_measured_s=statistics.median(spans),
        step_measured_s=statistics.median(walls),
        loss_forward_s=loss_f,
        loss_backward_s=loss_b,
        iteration_samples_s=spans,
    )
