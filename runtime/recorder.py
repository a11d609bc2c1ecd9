"""The runtime's recorder: times every (stage, micro-batch, phase) of a run into a Timeline.

The executor wraps each task in ``recorder.record(stage, microbatch, phase, device)``:
``forward`` and ``backward`` per (stage, micro-batch), and ``recompute`` for the
re-materialising forward inside a checkpointed backward (its interval nests in that
backward's; one per unit when the stage is re-materialized per unit). ``recorder.timeline()`` gives the one torch-free
:class:`autopipe.core.timeline.Timeline` that the simulator returns and the plots draw;
Chrome traces are its ``save_chrome_trace``.

Clocks: by default a task is timed with CUDA events on a CUDA device (turned into seconds on
``time.perf_counter``'s clock when the timeline is built, which synchronises each device once)
and with ``time.perf_counter`` elsewhere. ``clocks`` replaces that with named callables
returning seconds (a value of None is the default device clock), all read around every task;
``timeline(name)`` gives the tasks on one of them. A per-thread clock such as
``time.thread_time`` gives task durations in CPU seconds; its start times are only
comparable within one thread. Times are seconds since the recorder was created.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from autopipe.core.timeline import PHASES, Mark, Task, Timeline

__all__ = ["DEFAULT_CLOCKS", "Clock", "Span", "TimelineRecorder"]

Clock = Callable[[], float]
"""A clock: a callable returning seconds."""

DEFAULT_CLOCKS: Mapping[str, Clock | None] = {"wall": None}
"""One clock, ``"wall"``: CUDA events on CUDA devices, ``time.perf_counter`` elsewhere."""


@dataclass
class Span:
    """A task being timed: its identity and the stamps read at its start and end.

    A stamp is seconds from a clock, or a CUDA event for the default clock on a GPU.
    """

    stage: int
    microbatch: int
    phase: str
    device: int
    """The device's index in the timeline."""
    on: torch.device
    start: dict[str, Any]
    end: dict[str, Any] | None = None


class TimelineRecorder:
    """Collects the task intervals of one pipeline iteration (a forward and its backward).

    ``devices``: the stages' devices, which fix the device indices (in order of first
    appearance; a device first seen in ``record`` is added). Thread-safe: the workers and the
    autograd threads record concurrently. Cost per task: two reads of each clock (or two
    CUDA event records) and a lock.
    """

    def __init__(
        self,
        devices: Sequence[torch.device | str] = (),
        *,
        num_stages: int = 0,
        clocks: Mapping[str, Clock | None] | None = None,
        schedule: str = "gpipe",
        label: str = "measured",
    ) -> None:
        self.clocks: dict[str, Clock | None] = dict(clocks or DEFAULT_CLOCKS)
        if not self.clocks:
            raise ValueError("a timeline recorder needs at least one clock")
        self.num_stages = num_stages
        self.schedule = schedule
        self.label = label
        self._lock = threading.Lock()
        self._device_index: dict[str, int] = {}
        for device in devices:
            self._index_of(str(device))
        self._spans: list[Span] = []
        self._marks: list[Span] = []  # phase = the mark's name
        # Per CUDA device: (reference event, perf_counter seconds at that event).
        self._cuda_refs: dict[str, tuple[Any, float]] = {}
        self.origin = {name: float(_host_clock(clock)()) for name, clock in self.clocks.items()}
        """Each clock's reading when the recorder was created: time 0 of its timeline."""

    @property
    def origin_s(self) -> float:
        """The first clock's time 0."""
        return self.origin[next(iter(self.clocks))]

    def _index_of(self, name: str) -> int:
        return self._device_index.setdefault(name, len(self._device_index))

    def _cuda_ref(self, device: torch.device) -> tuple[Any, float]:
        key = str(device)
        with self._lock:
            if key not in self._cuda_refs:
                torch.cuda.synchronize(device)
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                torch.cuda.synchronize(device)
                self._cuda_refs[key] = (event, time.perf_counter())
            return self._cuda_refs[key]

    def _stamps(self, device: torch.device) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, clock in self.clocks.items():
            if clock is None and device.type == "cuda":
                self._cuda_ref(device)
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(device))
                out[name] = event
            else:
                out[name] = float(_host_clock(clock)())
        return out

    def begin(self, stage: int, microbatch: int, phase: str, device: torch.device) -> Span:
        """Start timing task ``(stage, microbatch, phase)`` on ``device``; :meth:`end` ends it
        (from any thread: a loss backward ends in an autograd hook)."""
        if phase not in PHASES:
            raise ValueError(f"unknown task phase {phase!r}; use one of {', '.join(PHASES)}")
        with self._lock:
            index = self._index_of(str(device))
        return Span(stage, microbatch, phase, index, device, self._stamps(device))

    def end(self, span: Span) -> None:
        """Finish ``span`` and keep it."""
        span.end = self._stamps(span.on)
        with self._lock:
            self._spans.append(span)

    @contextmanager
    def record(
        self, stage: int, microbatch: int, phase: str, device: torch.device
    ) -> Iterator[None]:
        """Time the body as task ``(stage, microbatch, phase)`` on ``device``."""
        span = self.begin(stage, microbatch, phase, device)
        try:
            yield
        finally:
            self.end(span)

    @contextmanager
    def mark(self, name: str, device: torch.device) -> Iterator[None]:
        """Time the body as mark ``name`` on ``device`` (a :class:`Mark`: a whole step, the
        optimizer step; not a stage's task)."""
        with self._lock:
            index = self._index_of(str(device))
        span = Span(-1, -1, name, index, device, self._stamps(device))
        try:
            yield
        finally:
            span.end = self._stamps(device)
            with self._lock:
                self._marks.append(span)

    def _seconds(self, clock: str, device: str, stamp: Any) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin[clock]
        ref_event, ref_s = self._cuda_refs[device]
        return ref_s + ref_event.elapsed_time(stamp) / 1e3 - self.origin[clock]

    def timeline(self, clock: str | None = None) -> Timeline:
        """The tasks recorded so far on ``clock`` (default: the first), sorted by start.

        Synchronises each CUDA device with pending events once. O(n log n).
        """
        name = next(iter(self.clocks)) if clock is None else clock
        if name not in self.clocks:
            raise KeyError(f"no clock {name!r} in this recorder; it has {', '.join(self.clocks)}")
        with self._lock:
            spans = list(self._spans)
            mark_spans = list(self._marks)
            names = sorted(self._device_index, key=self._device_index.__getitem__)
        for device in names:
            if device in self._cuda_refs:
                torch.cuda.synchronize(torch.device(device))
        tasks = []
        for span in spans:
            assert span.end is not None
            device = names[span.device]
            tasks.append(
                Task(
                    span.stage,
                    span.microbatch,
                    span.phase,
                    self._seconds(name, device, span.start[name]),
                    self._seconds(name, device, span.end[name]),
                    span.device,
                )
            )
        tasks.sort(key=lambda t: (t.start_s, t.stage, t.microbatch))
        marks = []
        for span in mark_spans:
            assert span.end is not None
            device = names[span.device]
            marks.append(
                Mark(
                    span.phase,
                    span.device,
                    self._seconds(name, device, span.start[name]),
                    self._seconds(name, device, span.end[name]),
                )
            )
        marks.sort(key=lambda k: (k.start_s, k.device))
        return Timeline(
            tasks,
            max(self.num_stages, 1 + max((t.stage for t in tasks), default=-1)),
            label=self.label,
            schedule=self.schedule,
            device_names=names,
            marks=marks,
        )


def _host_clock(clock: Clock | None) -> Clock:
    return time.perf_counter if clock is None else clock
