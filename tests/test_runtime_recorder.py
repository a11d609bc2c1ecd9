"""The runtime's recorder (``autopipe.runtime.recorder``) and the Chrome trace of what it records."""

from __future__ import annotations

import json

import torch
from autopipe.runtime.recorder import TimelineRecorder

from autopipe.core.timeline import load_chrome_trace


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
        (r.stage, r.phase, r.device) for r in tl.tasks
    ]
    assert all(abs(a.start_s - b.start_s) < 1e-9 for a, b in zip(back, tl.tasks, strict=True))
    assert tl.iteration_s >= 0 and tl.busy_s(1) >= 0
