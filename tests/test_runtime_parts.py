"""Runtime building blocks: micro-batching, the clock schedule, workers, the timeline."""

from __future__ import annotations

import json

import pytest
import torch
from autopipe.planner.simulate import fill_drain_bubble
from autopipe.runtime.microbatch import gather, scatter
from autopipe.runtime.schedule import clock_cycles
from autopipe.runtime.timeline import TimelineRecorder, load_chrome_trace
from autopipe.runtime.worker import worker_for


def test_scatter_uneven_small_and_broadcast() -> None:
    x, mask = torch.arange(10).view(10, 1), torch.ones(3, 3)
    pieces = scatter([x, mask, 7], 4)
    assert [p[0].shape[0] for p in pieces] == [3, 3, 2, 2]
    assert all(p[1] is mask and p[2] == 7 for p in pieces)  # other sizes / non-tensors broadcast
    assert torch.equal(torch.cat([p[0] for p in pieces]), x)
    assert len(scatter([torch.zeros(2, 5)], 7)) == 2  # fewer samples than chunks
    with pytest.raises(ValueError):
        scatter([x], 0)
    with pytest.raises(TypeError):
        scatter([3], 2)


def test_gather_nested_outputs() -> None:
    outs = [{"y": torch.full((2, 1), float(i)), "n": 5} for i in range(3)]
    joined = gather(outs)
    assert joined["n"] == 5 and joined["y"].flatten().tolist() == [0, 0, 1, 1, 2, 2]
    # A 0-dim loss per micro-batch: the mean weighted by the micro-batch sizes.
    loss = gather([torch.tensor(1.0), torch.tensor(4.0)], [3, 1])
    assert float(loss) == pytest.approx(1.75)
    with pytest.raises(TypeError, match="0-dim torch.int64"):
        gather([torch.tensor(1), torch.tensor(2)])


@pytest.mark.parametrize(("m", "k"), [(1, 1), (4, 3), (3, 5), (7, 2)])
def test_clock_cycles_respect_dependencies(m: int, k: int) -> None:
    clocks = list(clock_cycles(m, k))
    assert len(clocks) == m + k - 1
    when = {task: c for c, tasks in enumerate(clocks) for task in tasks}
    assert sorted(when) == [(i, j) for i in range(m) for j in range(k)]
    for (i, j), c in when.items():
        assert c == i + j
        if j > 0:
            assert when[(i, j - 1)] < c
        if i > 0:
            assert when[(i - 1, j)] < c  # a stage takes micro-batches in order
    assert fill_drain_bubble(m, k) == pytest.approx((k - 1) / (m + k - 1))


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


def test_chrome_trace_format(tmp_path) -> None:
    recorder = TimelineRecorder()
    cpu = torch.device("cpu")
    with recorder.record(0, 0, "forward", cpu):
        pass
    with recorder.record(1, 0, "backward", cpu), recorder.record(1, 0, "recompute", cpu):
        pass
    tl = recorder.timeline()
    trace = tl.to_chrome_trace()
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["tid"], e["cat"]) for e in slices} == {
        (0, "forward"),
        (1, "backward"),
        (1, "recompute"),
    }
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    path = tmp_path / "t.json"
    tl.save_chrome_trace(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))
    back = load_chrome_trace(path).tasks
    assert [(r.stage, r.phase, r.device) for r in back] == [
        (r.stage, r.phase, r.device) for r in tl.records
    ]
    assert all(abs(a.start_s - b.start_s) < 1e-9 for a, b in zip(back, tl.records, strict=True))
    assert tl.makespan_s() >= 0 and tl.busy_s(1) >= 0


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


def test_devices_are_normalised() -> None:
    from autopipe.runtime.devices import as_device

    assert as_device(2) == torch.device("cuda", 2)
    assert as_device("cpu") == torch.device("cpu") != as_device("cpu:0")
    if torch.cuda.is_available():
        assert as_device("cuda") == torch.device("cuda", torch.cuda.current_device())
