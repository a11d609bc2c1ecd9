"""One worker thread per device: runs a device's pipeline tasks in order.

Tasks are closures submitted with ``Worker.submit`` and return a
``concurrent.futures.Future``; an exception inside a task is stored in its future and
re-raised in the caller by ``Future.result``, so a failing stage never hangs the pipeline.
Workers are daemon threads shared by every pipeline in the process (``worker_for``), so a
program never leaks one thread per pipeline and exits even if a task is stuck.
Per-thread state that PyTorch keeps (grad mode, intra-op thread count, autocast for CPU and
CUDA) is copied from the submitting thread into each task.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["InlineWorker", "Worker", "worker_for"]

_AUTOCAST_TYPES = ("cpu", "cuda")


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions active in this thread: (device type, dtype) pairs."""
    return tuple(
        (kind, torch.get_autocast_dtype(kind))
        for kind in _AUTOCAST_TYPES
        if torch.is_autocast_enabled(kind)
    )


def _autocast(state: tuple[tuple[str, torch.dtype], ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kind, dtype in state:
        stack.enter_context(torch.autocast(kind, dtype=dtype))
    return stack


class Worker:
    """A daemon thread that runs submitted callables one after another."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._loop, name=f"autopipe-worker-{device}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        failure: BaseException | None = None
        if self.device.type == "cuda":
            try:
                torch.cuda.set_device(self.device)
            except BaseException as exc:  # noqa: BLE001 - reported through every future below
                # A thread that died here would leave its futures pending forever (a hang).
                failure = exc
        while True:
            future, fn, grad_enabled, threads, autocast = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if failure is not None:
                    raise failure
                if torch.get_num_threads() != threads:
                    # OpenMP's thread count is per thread: without this a worker would use
                    # every core while the caller asked for fewer, oversubscribing the CPU.
                    torch.set_num_threads(threads)
                with torch.set_grad_enabled(grad_enabled), _autocast(autocast):
                    result = fn()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn`` to run on this worker with the caller's grad mode, thread count and
        autocast state; returns its future."""
        future: Future[Any] = Future()
        state = (future, fn, torch.is_grad_enabled(), torch.get_num_threads(), _autocast_state())
        self._queue.put(state)
        return future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class InlineWorker:
    """Runs a submitted callable at once in the calling thread (a one-device pipeline)."""

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller via the future
            future.set_exception(exc)
        return future


_WORKERS: dict[str, Worker] = {}
_LOCK = threading.Lock()


def worker_for(device: torch.device) -> Worker:
    """The process-wide worker of ``device`` (created on first use)."""
    key = str(device)
    with _LOCK:
        worker = _WORKERS.get(key)
        if worker is None or not worker.alive:
            worker = _WORKERS[key] = Worker(device)
        return worker
