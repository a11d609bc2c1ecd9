"""The worker threads (``autopipe.runtime.worker``): one per device, exceptions through futures."""

from __future__ import annotations

import pytest
import torch
from autopipe.runtime.worker import worker_for


def test_worker_propagates_exceptions_and_grad_mode() -> None:
    worker = worker_for(torch.device("cpu"))
    with torch.no_grad():
        assert worker.submit(torch.is_grad_enabled).result(timeout=5) is False
    assert worker.submit(torch.is_grad_enabled).result(timeout=5) is True

    def fail() -> None:
        raise KeyError("from the worker")

    with pytest.raises(KeyError, match="from the worker"):
        worker.submit(fail).result(timeout=5)
    assert worker.alive and worker.submit(lambda: 3).result(timeout=5) == 3


def test_worker_copies_autocast_state() -> None:
    worker = worker_for(torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = worker.submit(lambda: (torch.ones(2, 2) @ torch.ones(2, 2)).dtype).result(timeout=5)
    assert dtype == torch.bfloat16
    assert (
        worker.submit(lambda: (torch.ones(2, 2) @ torch.ones(2, 2)).dtype).result(timeout=5)
        == torch.float32
    )


def test_worker_that_cannot_select_its_gpu_fails_its_tasks_instead_of_hanging() -> None:
    from autopipe.runtime.worker import Worker

    # No such GPU here (or no CUDA at all): torch.cuda.set_device fails in the thread.
    future = Worker(torch.device("cuda", 4096)).submit(lambda: 1)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the CUDA error type varies by build
        future.result(timeout=5)
    assert not isinstance(info.value, TimeoutError)
