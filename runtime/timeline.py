"""Timeline of a pipeline run: when each (stage, micro-batch, phase) started and ended.

Phases are ``"forward"``, ``"backward"`` and ``"recompute"`` (the re-materialising forward
that runs inside a checkpointed backward, so its interval nests inside that backward's).
On CPU times come from ``time.perf_counter``; on CUDA from CUDA events, which are turned
into seconds on the same clock when the timeline is read (``records`` synchronises once).
Times are seconds since the timeline began. ``to_chrome_trace`` gives the Chrome trace JSON
format that Perfetto and chrome://tracing open: one process per device, one thread per stage.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PHASES",
    "TaskRecord",
    "Timeline",
    "load_chrome_trace",
    "save_chrome_trace",
    "to_chrome_trace",
]

PHASES = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class TaskRecord:
    """One task of the run. ``start_s``/``end_s`` are seconds since the timeline began."""

    stage: int
    microbatch: int
    phase: str
    device: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class _Pending:
    stage: int
    microbatch: int
    phase: str
    device: str
    start: Any
    """perf_counter seconds, or a CUDA event."""
    end: Any


class Timeline:
    """Collects task intervals of one pipeline iteration (forward and its backward)."""

    def __init__(self) -> None:
        self.origin_s = time.perf_counter()
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        # Per CUDA device: (reference event, perf_counter seconds at that event).
        self._cuda_refs: dict[str, tuple[Any, float]] = {}

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

    @contextmanager
    def record(
        self, stage: int, microbatch: int, phase: str, device: torch.device
    ) -> Iterator[None]:
        """Time the body as task ``(stage, microbatch, phase)`` on ``device``."""
        if device.type == "cuda":
            self._cuda_ref(device)
            stream = torch.cuda.current_stream(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end.record(stream)
                self._append(_Pending(stage, microbatch, phase, str(device), start, end))
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self._append(
                _Pending(stage, microbatch, phase, str(device), start_s, time.perf_counter())
            )

    def _append(self, pending: _Pending) -> None:
        with self._lock:
            self._pending.append(pending)

    def _seconds(self, device: str, stamp: Any) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin_s
        ref_event, ref_s = self._cuda_refs[device]
        return ref_s + ref_event.elapsed_time(stamp) / 1e3 - self.origin_s

    @property
    def records(self) -> list[TaskRecord]:
        """All tasks recorded so far, sorted by start time (synchronises CUDA devices once)."""
        with self._lock:
            pending = list(self._pending)
        for device in {p.device for p in pending if not isinstance(p.start, float)}:
            torch.cuda.synchronize(torch.device(device))
        out = [
            TaskRecord(
                p.stage,
                p.microbatch,
                p.phase,
                p.device,
                self._seconds(p.device, p.start),
                self._seconds(p.device, p.end),
            )
            for p in pending
        ]
        return sorted(out, key=lambda r: (r.start_s, r.stage, r.microbatch))

    def of(self, phase: str) -> list[TaskRecord]:
        """Records of one phase."""
        return [r for r in self.records if r.phase == phase]

    def makespan_s(self) -> float:
        """Seconds from the first task's start to the last task's end (0 when empty)."""
        recs = self.records
        return max(r.end_s for r in recs) - min(r.start_s for r in recs) if recs else 0.0

    def busy_s(self, stage: int) -> float:
        """Seconds stage ``stage`` spent in forward and backward (recompute nests in backward)."""
        return sum(
            r.duration_s for r in self.records if r.stage == stage and r.phase != "recompute"
        )

    def to_chrome_trace(self) -> dict[str, Any]:
        return to_chrome_trace(self.records)

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        save_chrome_trace(self.records, path)


def to_chrome_trace(records: list[TaskRecord]) -> dict[str, Any]:
    """Chrome trace JSON object (``traceEvents``, microsecond ``ts``/``dur``) for Perfetto."""
    devices = sorted({r.device for r in records})
    pid_of = {d: i for i, d in enumerate(devices)}
    events: list[dict[str, Any]] = []
    for device, pid in pid_of.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": device}})
    for stage in sorted({(r.device, r.stage) for r in records}):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid_of[stage[0]],
                "tid": stage[1],
                "args": {"name": f"stage {stage[1]}"},
            }
        )
    for r in records:
        events.append(
            {
                "name": f"{r.phase[0].upper()}{r.microbatch}",
                "cat": r.phase,
                "ph": "X",
                "pid": pid_of[r.device],
                "tid": r.stage,
                "ts": r.start_s * 1e6,
                "dur": max(r.duration_s, 0.0) * 1e6,
                "args": {"stage": r.stage, "microbatch": r.microbatch, "phase": r.phase},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(records: list[TaskRecord], path: str | os.PathLike[str]) -> None:
    """Write ``records`` as a Chrome trace JSON file."""
    Path(path).write_text(json.dumps(to_chrome_trace(records)))


def load_chrome_trace(path: str | os.PathLike[str]) -> list[TaskRecord]:
    """Read back the task records of a trace written by ``save_chrome_trace``."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    devices = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    records = [
        TaskRecord(
            e["args"]["stage"],
            e["args"]["microbatch"],
            e["args"]["phase"],
            devices.get(e["pid"], str(e["pid"])),
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
        )
        for e in events
        if e.get("ph") == "X"
    ]
    return sorted(records, key=lambda r: (r.start_s, r.stage, r.microbatch))
