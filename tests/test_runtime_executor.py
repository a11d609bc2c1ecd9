"""Running K stages over M micro-batches in the fill-drain order (autopipe.runtime.executor),
with plain functions as stages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from autopipe.runtime.executor import Stage, run_pipeline
from autopipe.runtime.recorder import TimelineRecorder
from autopipe.runtime.rng import MicrobatchRNG, microbatch_seed

CPU = torch.device("cpu")


def logging_stages(
    k: int, log: list[tuple[int, int]], fail: tuple[int, int] | None = None
) -> list[Stage]:
    """Stage j doubles its (positive) input through a ReLU, which saves a tensor for
    backward, and logs (micro-batch, stage); ``i`` travels with the values."""

    def make(j: int) -> Stage:
        def fn(h: torch.Tensor, i: int) -> tuple[Any, ...]:
            log.append((i, j))
            if (i, j) == fail:
                raise RuntimeError(f"stage {j} failed on micro-batch {i}")
            return torch.relu(h) * 2.0, i

        return Stage(fn=fn, device=CPU)

    return [make(j) for j in range(k)]


def run(stages: list[Stage], inputs: list[tuple[Any, ...]], **kwargs: Any) -> list[tuple[Any, ...]]:
    recorder = kwargs.pop("recorder", TimelineRecorder([CPU] * len(stages), num_stages=len(stages)))
    return run_pipeline(
        stages,
        inputs,
        checkpoint=kwargs.pop("checkpoint", lambda i, j: False),
        recorder=recorder,
        rng=kwargs.pop("rng", None),
    )


def test_tasks_run_in_clock_order_and_every_microbatch_passes_every_stage() -> None:
    log: list[tuple[int, int]] = []
    inputs = [(torch.full((2,), float(i + 1)), i) for i in range(3)]
    with torch.no_grad():
        out = run(logging_stages(2, log), inputs)
    # clocks: (0,0) | (1,0) (0,1) | (2,0) (1,1) | (2,1); a clock's tasks stage ascending
    assert log == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]
    assert [i for _, i in out] == [0, 1, 2]
    assert [h.tolist() for h, _ in out] == [[4.0, 4.0], [8.0, 8.0], [12.0, 12.0]]


def test_a_failed_task_stops_the_run_after_its_clock() -> None:
    log: list[tuple[int, int]] = []
    inputs = [(torch.ones(1), i) for i in range(3)]
    with pytest.raises(RuntimeError, match="stage 0 failed on micro-batch 1"):
        with torch.no_grad():
            run(logging_stages(2, log, fail=(1, 0)), inputs)
    assert log == [(0, 0), (1, 0)]  # nothing of clock 2 ran


def test_each_task_is_recorded_and_backward_reaches_the_inputs() -> None:
    recorder = TimelineRecorder([CPU] * 3, num_stages=3)
    x = torch.ones(4, requires_grad=True)
    stages = logging_stages(3, [])
    out = run(stages, [(x[:2], 0), (x[2:], 1)], recorder=recorder, checkpoint=lambda i, j: j == 1)
    torch.cat([h for h, _ in out]).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [8.0] * 4
    timeline = recorder.timeline()
    assert len(timeline.of("forward")) == 6 and len(timeline.of("backward")) == 6
    # Only stage 1 is re-materialized: one recompute per micro-batch there.
    assert sorted((t.stage, t.microbatch) for t in timeline.of("recompute")) == [(1, 0), (1, 1)]


def test_each_microbatch_draws_from_its_own_stream() -> None:
    def noisy(h: torch.Tensor) -> tuple[torch.Tensor]:
        return (h + torch.rand(h.shape),)

    stages = [Stage(fn=noisy, device=CPU), Stage(fn=noisy, device=CPU)]
    with torch.no_grad():
        out = run(stages, [(torch.zeros(2),), (torch.zeros(2),)], rng=MicrobatchRNG(base_seed=11))
    for i, (h,) in enumerate(out):
        gen = torch.Generator()
        gen.manual_seed(microbatch_seed(11, i))
        first, second = torch.rand(2, generator=gen), torch.rand(2, generator=gen)
        torch.testing.assert_close(h, first + second)
