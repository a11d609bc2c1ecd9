"""Timing of forward/backward pairs (the time model they feed: ``time_model.py``).

Times are medians over ``repeat`` runs after ``warmup`` runs, on the wall clock or the
measuring thread's CPU clock; on CUDA the device is synchronised around each timed region so
the clock measures the kernels, not the launch.
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


def resolve_clock(clock: str | Callable[[], float]) -> Callable[[], float]:
    """The clock function for a name in :data:`CLOCKS`, or ``clock`` itself if callable
    (e.g. a seeded fake clock in tests). ``ValueError`` for an unknown name."""
    if callable(clock):
        return clock
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r} is not one of {', '.join(CLOCKS)}")
    return CLOCKS[clock]


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
    CPU kernels); a callable is used as the clock.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    now = resolve_clock(clock)
    samples: list[tuple[list[float], list[float]]] = [([], []) for _ in steps]
    for r in range(warmup + repeat):
        for step, (fwd, bwd) in zip(steps, samples, strict=True):
            for _ in range(max(step.samples_per_round, 1) if r >= warmup else 1):
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
