"""Timing of forward/backward pairs (the time model they feed: ``time_model.py``).

Times are medians over ``repeat`` runs after ``warmup`` runs, on the wall clock, the
measuring thread's CPU clock or (CUDA, the default there) CUDA events recorded around each
timed region; with a host clock on CUDA the device is synchronised around each timed region
so the clock measures the kernels, not the launch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (None leaves it alone)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass
class TimedStep:
    """A forward/backward pair to time: ``backward(forward())``, then untimed ``reset()``.

    ``samples_per_round``: how many times the pair runs in each timed round (a measurement
    that several identical units share gets more samples; warm-up rounds run it once).
    """

    forward: Callable[[], Any]
    backward: Callable[[Any], None]
    reset: Callable[[], None] | None = None
    samples_per_round: int = 1


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "thread_cpu": time.thread_time,
}
CUDA_EVENTS = "cuda_events"
"""Clock name: CUDA events recorded on the current stream around forward and backward (the
kernels' own time on the device, without host launch gaps between timed regions)."""


def resolve_clock(clock: str | Callable[[], float]) -> Callable[[], float]:
    """The clock function for a name in :data:`CLOCKS`, or ``clock`` itself if callable
    (e.g. a seeded fake clock in tests). ``ValueError`` for an unknown name."""
    if callable(clock):
        return clock
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {', '.join((*CLOCKS, CUDA_EVENTS))}")
    return CLOCKS[clock]


def _time_with_events(
    step: TimedStep, device: torch.device
) -> tuple[float, float]:  # pragma: no cover - needs a GPU (benchmarks/gpu_check.py runs it)
    stream = torch.cuda.current_stream(device)
    start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record(stream)
    out = step.forward()
    middle.record(stream)
    step.backward(out)
    end.record(stream)
    del out
    end.synchronize()
    return start.elapsed_time(middle) / 1e3, middle.elapsed_time(end) / 1e3


def time_steps_interleaved(
    steps: Sequence[TimedStep],
    device: torch.device,
    *,
    warmup: int = 2,
    repeat: int = 5,
    tick: Callable[[], None] | None = None,
    clock: str | Callable[[], float] = "wall",
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds of each step, timed in interleaved rounds.

    Round ``r`` runs every step once (``samples_per_round`` times after warm-up), in order;
    medians are taken over the samples of the rounds after ``warmup``. Interleaving makes slow drifts of machine load (other processes on a shared
    host) hit all steps alike, so per-unit times stay comparable with each other and with a
    whole-model step timed in the same rounds. ``tick()`` runs after each round.

    ``clock``: ``"wall"`` (``time.perf_counter``) or ``"thread_cpu"`` (``time.thread_time``:
    CPU seconds of the calling thread, blind to time the thread waits while other processes
    run; equal to wall time on an idle machine, and only meaningful for single-threaded
    CPU kernels), ``"cuda_events"`` (CUDA events on the current stream: device time of
    the kernels) or a callable, used as the clock.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    events = clock == CUDA_EVENTS
    if events and device.type != "cuda":
        raise ValueError(f"clock {CUDA_EVENTS!r} needs a CUDA device, got {device}")
    now = time.perf_counter if events else resolve_clock(clock)
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in steps]
    for r in range(warmup + repeat):
        for step, (fwd, bwd) in zip(steps, samples, strict=True):
            for _ in range(max(step.samples_per_round, 1) if r >= warmup else 1):
                if events:
                    f_s, b_s = _time_with_events(step, device)
                    if step.reset is not None:
                        step.reset()
                    if r >= warmup:
                        fwd.append(f_s)
                        bwd.append(b_s)
                    continue
                synchronize(device)
                t0 = now()
                out = step.forward()
                synchronize(device)
                t1 = now()
                step.backward(out)
                synchronize(device)
                t2 = now()
                del out
                if step.reset is not None:
                    step.reset()
                if r >= warmup:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
        if tick is not None:
            tick()
    return [(statistics.median(f), statistics.median(b)) for f, b in samples]
