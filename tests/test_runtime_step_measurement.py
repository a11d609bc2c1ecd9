"""Measuring a plan's training steps with the executor (autopipe.runtime.step_measurement),
on a tiny two-stage plan."""

from __future__ import annotations

import time

import pytest
import torch
from autopipe.profiler.units import trace_units
from autopipe.runtime.step_measurement import choose_clock, clocks_for, measure_steps
from torch import nn

from autopipe.core.plan import Plan, StagePlan


def tiny() -> tuple[nn.Module, torch.Tensor, Plan]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 4)
    names = trace_units(model, x).unit_names
    stages = [
        StagePlan(index=0, device="cpu", units=names[:2]),
        StagePlan(index=1, device="cpu", units=names[2:]),
    ]
    return model, x, Plan(2, 3, 2, 6, stages)


def test_the_recorder_clocks_of_each_comparison_clock() -> None:
    assert clocks_for("wall") == {"wall": None}
    assert clocks_for("thread_cpu") == {"wall": None, "thread_cpu": time.thread_time}
    assert choose_clock("auto", ["cpu", "cpu:0"], threads=1) == "thread_cpu"
    assert choose_clock("auto", [], threads=1) == "wall"


def test_measured_steps_hold_every_task_and_train_the_model() -> None:
    model, x, plan = tiny()
    before = model[0].weight.detach().clone()
    measurement = measure_steps(model, x, plan, steps=2, warmup=1, clock="wall", lr=0.1)
    assert measurement.clock == "wall" and measurement.devices == ["cpu", "cpu"]
    assert len(measurement.steps) == 2  # the warm-up step is not kept
    for step in measurement.steps:
        timeline = step.timeline
        assert len(timeline.of("forward")) == 6 and len(timeline.of("backward")) == 6
        loss = timeline.of("loss")
        assert [(t.stage, t.microbatch) for t in loss] == [(1, -1), (1, -1)]
        assert min(t.start_s for t in timeline.tasks) == 0.0  # shifted to start at 0
        assert step.task_timeline is timeline and step.iteration_s == timeline.iteration_s
        assert 0 < step.iteration_s <= step.step_wall_s
        forward_s, backward_s = step.loss_s()
        assert forward_s > 0 and backward_s > 0
    assert not torch.equal(model[0].weight, before)  # three SGD steps moved the weights


def test_bad_step_counts_are_refused_before_any_work() -> None:
    model, x, plan = tiny()
    with pytest.raises(ValueError, match="steps=0 must be >= 1 and warmup=0 >= 0"):
        measure_steps(model, x, plan, steps=0, warmup=0)
    with pytest.raises(ValueError, match="clock 'sundial' is not one of auto, wall, thread_cpu"):
        choose_clock("sundial", ["cpu"], threads=1)
