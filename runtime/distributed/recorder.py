"""Record what each rank of a :class:`DistributedPipeline` ran, and when, into one Timeline.

``PipelineTrace(pipe)`` times, on every rank, each chunk's ``forward``, ``backward`` (or
``backward_input`` and ``backward_weight`` in the zero-bubble schedules) per micro-batch as
torch's schedule calls them (the ``PipelineStage`` methods ``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``), each micro-batch's ``loss`` (torch
computes it after the last chunk's forward, outside it), each whole step (mark ``"step"``:
``pipe.step`` from call to return) and, when the caller wraps it in :meth:`optimizer`, the
optimizer step (mark ``"optimizer"``). What is not timed (waiting for a peer's activations
or gradients, posting sends and receives, the schedule's own bookkeeping) is the time
between those spans. :meth:`gather` collects every rank's spans into one
:class:`autopipe.core.timeline.Timeline` on rank 0, device = pipeline rank, the input of
``autopipe replay``.

Clocks: ranks on one host share ``time.perf_counter``'s (CLOCK_MONOTONIC), and their spans
are placed on it exactly; ranks on several hosts are aligned by a barrier at the trace's
creation (to within its exit skew, tens of microseconds on a LAN). On a GPU, the recorder's
CUDA events (see :mod:`autopipe.runtime.recorder`).
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from autopipe.runtime.recorder import TimelineRecorder

from autopipe.core.timeline import Timeline

__all__ = ["PipelineTrace"]


class PipelineTrace:
    """Times this rank's part of ``pipe`` (a :class:`DistributedPipeline`) from now on; build
    one on every rank, after the pipeline and before its first step."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        dist.barrier()  # time 0 of every rank's recorder: the same instant, to its skew
        self.recorder = TimelineRecorder(
            [pipe.device],
            num_stages=len(pipe.plan.stages),
            schedule=pipe.plan.schedule,
            label="measured",
        )
        pipe.recorder = self.recorder
        for stage in pipe.stages:
            self._wrap(stage)

    def _wrap(self, stage: Any) -> None:
        record = self.recorder.record
        device = self.pipe.device
        c = int(stage.stage_index)

        def timed(fn: Callable[..., Any], phase_of: Callable[..., str]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                with record(c, int(chunk_id), phase_of(*args, **kwargs), device):
                    return fn(chunk_id, *args, **kwargs)

            return run

        def backward_phase(loss: Any = None, full_backward: bool = True, *_: Any, **__: Any) -> str:
            return "backward" if full_backward else "backward_input"

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda *a, **k: "forward")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, backward_phase)
        stage.backward_weight_one_chunk = timed(
            stage.backward_weight_one_chunk, lambda *a, **k: "backward_weight"
        )

    @contextlib.contextmanager
    def optimizer(self) -> Iterator[None]:
        """Time the body as this step's optimizer step (mark ``"optimizer"``)."""
        with self.recorder.mark("optimizer", self.pipe.device):
            yield

    def gather(self) -> Timeline | None:
        """Every pipeline rank's spans so far (of replica 0) as one Timeline on global rank 0
        (device index = pipeline rank, named ``"rank r (device)"``), None on the others.
        Collective: call on every rank."""
        layout = self.pipe.layout
        mine = (
            layout.stage,
            layout.replica,
            socket.gethostname(),
            self.recorder.origin_s,
            self.recorder.timeline(),
        )
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        if dist.get_rank() != 0:
            return None
        parts = sorted((p for p in parts if p[1] == 0), key=lambda p: p[0])
        one_host = len({p[2] for p in parts}) == 1
        origin = min(p[3] for p in parts)
        tasks, marks, names = [], [], []
        for rank, _, _, origin_s, timeline in parts:
            # One host: the same monotonic clock, placed exactly; else the barrier's instant.
            shift = origin_s - origin if one_host else 0.0
            names.append(f"rank {rank} ({timeline.device_name(0)})")
            tasks += [
                replace(t, start_s=t.start_s + shift, end_s=t.end_s + shift, device=rank)
                for t in timeline.tasks
            ]
            marks += [
                replace(k, start_s=k.start_s + shift, end_s=k.end_s + shift, device=rank)
                for k in timeline.marks
            ]
        tasks.sort(key=lambda t: (t.start_s, t.stage, t.microbatch))
        marks.sort(key=lambda k: (k.start_s, k.device))
        return Timeline(
            tasks,
            len(self.pipe.plan.stages),
            label="measured",
            schedule=self.pipe.plan.schedule,
            device_names=names,
            marks=marks,
        )
