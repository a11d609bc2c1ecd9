"""`autopipe bench` and `autopipe plot` end to end on a tiny model (mechanics, not speed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from autopipe import cli
from autopipe.core.plan import load_plan

MODEL = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    return output.square().mean()
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A model file, its measured profile and a 2-stage plan with M = 4."""
    import torch
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest
    from autopipe.modelfile import load_model_file

    tmp = tmp_path_factory.mktemp("bench")
    model_py = tmp / "tiny.py"
    model_py.write_text(MODEL)
    mf = load_model_file(str(model_py))
    torch.set_num_threads(1)
    prof = profile(
        mf.build(),
        mf.inputs(8),
        MeasureOptions(warmup=1, repeat=2),
        loss_fn=mf.loss_fn,
        progress=False,
    )
    prof_path = tmp / "profile.json"
    prof.save(prof_path)
    p = plan(prof, PlanRequest(gpus=2, batch_size=8, microbatches=4))
    plan_path = tmp / "plan.json"
    p.save(plan_path)
    return model_py, prof_path, plan_path


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 250


@pytest.fixture(scope="module")
def bench_run(setup, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One `autopipe bench --json` run: its report and output directory."""
    model_py, _, plan_path = setup
    out = tmp_path_factory.mktemp("bench-out")
    argv = ["bench", str(model_py), "--plan", str(plan_path), "--steps", "2", "--out", str(out)]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main([*argv, "--json"]) == 0
    return json.loads(buf.getvalue()), out


def test_bench_json_and_files(setup, bench_run) -> None:
    _, _, plan_path = setup
    report, out = bench_run
    assert report["num_stages"] == 2 and report["microbatches"] == 4
    # Both stages run on this machine's CPU: simulated as one shared device.
    assert report["devices"] == ["cpu", "cpu"]
    assert report["shared_device_groups"] == [[0, 1]]
    # All-CPU, single-threaded: compared on the thread-CPU clock like the profiler's times.
    assert report["clock"] == "thread_cpu"
    assert report["iteration_wall_s"] > 0
    # The executor's per-task cost is calibrated (>= 0) and included in each prediction.
    of, ob = report["executor_overhead_forward_s"], report["executor_overhead_backward_s"]
    assert 0 <= of < 1e-3 and 0 <= ob < 1e-3
    p0 = load_plan(plan_path).stages[0]
    assert report["stages"][0]["forward_predicted_s"] == pytest.approx(p0.forward_s + of)
    assert len(report["stages"]) == 2
    for s in report["stages"]:
        assert s["forward_measured_s"] > 0 and s["backward_measured_s"] > 0
        assert s["forward_error"] == pytest.approx(
            (s["forward_predicted_s"] - s["forward_measured_s"]) / s["forward_measured_s"]
        )
    # On one shared device the prediction is the sum of all tasks, not the pipelined time.
    p = load_plan(plan_path)
    total = (sum(s.time_s for s in p.stages) + p.num_stages * (of + ob)) * p.microbatches
    assert report["iteration_predicted_s"] == pytest.approx(total)
    assert len(report["iteration_measured_samples_s"]) == 2
    _png_ok(out / "timeline_compare.png")
    from autopipe.core.timeline import load_chrome_trace

    measured = load_chrome_trace(out / "trace.json")
    assert measured.num_stages == 2 and measured.num_microbatches == 4
    assert len(measured.durations(0, "forward")) == 4
    assert len(measured.durations(1, "backward")) == 4
    assert measured.shared
    assert (out / "bench.json").is_file()


def test_bench_table(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_py, _, plan_path = setup
    rc = cli.main(
        ["bench", str(model_py), "--plan", str(plan_path), "--steps", "1", "--warmup", "0",
         "--out", str(tmp_path), "--no-executor-overhead"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    assert "fwd pred ms" in text and "iteration      predicted" in text
    assert "simulated as sharing: stages 0+1" in text


def test_choose_clock() -> None:
    from autopipe.bench_report import choose_clock

    assert choose_clock("auto", ["cpu", "cpu"], threads=1) == "thread_cpu"
    assert choose_clock("auto", ["cpu", "cpu"], threads=4) == "wall"
    assert choose_clock("auto", ["cuda:0", "cuda:1"], threads=1) == "wall"
    assert choose_clock("wall", ["cpu"], threads=1) == "wall"
    with pytest.raises(ValueError, match="clock"):
        choose_clock("tsc", ["cpu"], threads=1)


def test_bench_bad_input(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_py, _, plan_path = setup
    base = ["bench", str(model_py), "--out", str(tmp_path)]
    assert cli.main([*base, "--plan", str(tmp_path / "none.json")]) == 2
    assert "plan file not found" in capsys.readouterr().err
    assert cli.main([*base, "--plan", str(plan_path), "--devices", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "1 devices but the plan has 2 stages" in err and "Traceback" not in err
    assert cli.main([*base, "--plan", str(plan_path), "--devices", "cpu,meta"]) == 2
    assert "meta device" in _err_line(capsys)
    assert cli.main([*base, "--plan", str(plan_path), "--devices", "cpu,cuda:99"]) == 2
    assert "CUDA device(s)" in _err_line(capsys)
    # An --out that is a file is refused before any training step, and nothing is written.
    assert (
        cli.main(["bench", str(model_py), "--plan", str(plan_path), "--out", str(plan_path)]) == 2
    )
    assert "is a file; give a directory" in _err_line(capsys)
    other = tmp_path / "other.py"
    other.write_text(MODEL.replace("nn.Linear(64, 4)", "nn.ReLU(), nn.Linear(64, 4)"))
    assert cli.main(["bench", str(other), "--plan", str(plan_path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "units" in err


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_plot_command(setup, bench_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_py, prof_path, plan_path = setup
    out = tmp_path / "plots"
    argv = ["plot", str(plan_path), "--profile", str(prof_path), "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    files = [Path(f).name for f in json.loads(capsys.readouterr().out)["files"]]
    assert files == ["timeline.png", "memory.png", "bubble.png", "balance.png", "scaling.png"]
    for name in files:
        _png_ok(out / name)
    # The measured trace written by bench, drawn under the prediction.
    trace = bench_run[1] / "trace.json"
    rc = cli.main(
        ["plot", str(plan_path), "--timeline", str(trace), "--compare",
         "--out", str(out), "--format", "png,svg", "-q"]
    )  # fmt: skip
    assert rc == 0
    assert (out / "timeline_compare.png").is_file() and (out / "timeline_compare.svg").is_file()
    _png_ok(out / "timeline_measured.png")
    # A trace of another pipeline (stage 5 of a 2-stage plan) is refused, not drawn.
    other = tmp_path / "other_trace.json"
    task = {"stage": 5, "microbatch": 0, "phase": "forward"}
    other.write_text(
        json.dumps([{"ph": "X", "name": "F0", "tid": 5, "ts": 0, "dur": 1, "args": task}])
    )
    assert cli.main(["plot", str(plan_path), "--timeline", str(other), "--out", str(out)]) == 2
    assert "has 6 stages but the plan has 2" in _err_line(capsys)
    assert cli.main(["plot", str(plan_path), "--out", str(plan_path)]) == 2
    assert "is a file; give a directory" in _err_line(capsys)
    assert cli.main(["plot", str(plan_path), "--compare", "--out", str(out)]) == 2
    assert "--compare needs --timeline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse rejects the format: usage error
        cli.main(["plot", str(plan_path), "--out", str(out), "--format", "gif"])
    assert exc.value.code == 2


def test_reads_the_executors_chrome_trace() -> None:
    from autopipe.core.timeline import Task, Timeline, load_chrome_trace, to_chrome_trace

    records = [  # the one Task: stage, micro-batch, phase, start_s, end_s, device index
        Task(0, 0, "forward", 0.000, 0.010, 0),
        Task(1, 0, "forward", 0.010, 0.020, 0),
        Task(1, 0, "backward", 0.030, 0.050, 0),
        Task(1, 0, "recompute", 0.031, 0.039, 0),
        Task(0, 0, "backward", 0.050, 0.070, 0),
    ]
    run = Timeline(records, 2, device_names=["cpu"])
    tl = load_chrome_trace(to_chrome_trace(run))
    assert tl.num_stages == 2 and tl.shared  # both stages on the one CPU
    assert tl.durations(1, "backward") == pytest.approx([0.020])
    assert tl.durations(1, "recompute") == pytest.approx([0.008])
    # The nested recompute is not counted twice; the 10 ms gap is the only idle time.
    assert tl.bubble_fraction == pytest.approx(0.010 / 0.070)
    assert run.iteration_s == pytest.approx(0.070)
