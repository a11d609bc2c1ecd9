"""Timing forward/backward pairs in interleaved rounds (autopipe.profiler.timing), on a
scripted clock so every figure is exact."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from autopipe.profiler.timing import (
    CLOCKS,
    TimedStep,
    num_threads,
    resolve_clock,
    time_steps_interleaved,
)

CPU = torch.device("cpu")


class ScriptedClock:
    """A clock that each step's forward and backward advance by chosen seconds."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def step(
        self, forward_s: Callable[[int], float], backward_s: float, log: list[str], name: str
    ) -> TimedStep:
        calls = {"n": 0}

        def forward() -> int:
            calls["n"] += 1
            log.append(f"{name}F")
            self.now_s += forward_s(calls["n"])
            return calls["n"]

        def backward(_out: int) -> None:
            log.append(f"{name}B")
            self.now_s += backward_s

        return TimedStep(forward, backward, reset=lambda: log.append(f"{name}R"))


def test_medians_after_warmup_on_the_given_clock() -> None:
    """The first (warm-up) call is slow and left out; the median of the rest is returned."""
    clock, log = ScriptedClock(), []
    # forward: 1.0 s on warm-up, then 0.1, 0.3, 0.2; backward always 0.5 s
    durations = {1: 1.0, 2: 0.1, 3: 0.3, 4: 0.2}
    a = clock.step(lambda n: durations[n], 0.5, log, "a")
    b = clock.step(lambda n: 0.04, 0.08, log, "b")
    (fa, ba), (fb, bb) = time_steps_interleaved([a, b], CPU, warmup=1, repeat=3, clock=clock)
    assert fa == pytest.approx(0.2) and ba == pytest.approx(0.5)
    assert fb == pytest.approx(0.04) and bb == pytest.approx(0.08)
    # Interleaved: each round runs a then b, each forward, backward, reset.
    assert log == ["aF", "aB", "aR", "bF", "bB", "bR"] * 4


def test_samples_per_round_and_tick() -> None:
    clock, log, ticks = ScriptedClock(), [], []
    step = clock.step(lambda n: 0.01 * n, 0.0, log, "s")
    step.samples_per_round = 3
    ((forward_s, _),) = time_steps_interleaved(
        [step], CPU, warmup=1, repeat=2, clock=clock, tick=lambda: ticks.append(1)
    )
    # warm-up runs once (call 1), then two rounds of three: calls 2..7, median of 0.02..0.07
    assert log.count("sF") == 7 and len(ticks) == 3
    assert forward_s == pytest.approx(0.045)


def test_bad_clock_and_repeat_are_refused() -> None:
    step = TimedStep(lambda: None, lambda _: None)
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        time_steps_interleaved([step], CPU, repeat=0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        time_steps_interleaved([step], CPU, clock="cuda_events")
    with pytest.raises(ValueError, match="clock 'sundial' is not one of wall, thread_cpu"):
        resolve_clock("sundial")
    assert resolve_clock("wall") is time.perf_counter
    assert resolve_clock("thread_cpu") is time.thread_time is CLOCKS["thread_cpu"]


def test_num_threads_is_restored() -> None:
    before = torch.get_num_threads()
    with num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with num_threads(None):
        assert torch.get_num_threads() == before
