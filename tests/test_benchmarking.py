"""``autopipe.benchmarking.bench_model_file``: what ``autopipe bench`` runs and writes, from
Python."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from autopipe.benchmarking import BenchRequest, bench_model_file
from autopipe.cli import main
from autopipe.core.errors import UsageError
from autopipe.core.plan import Plan, replace_plan

MODEL = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def example_inputs(batch_size=4):
    return torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0))


def loss_fn(output, inputs):
    return output.square().mean()
"""

MEASURED = {
    "iteration_measured_s",
    "iteration_error",
    "iteration_measured_samples_s",
    "iteration_wall_s",
    "step_measured_s",
    "loss_forward_s",
    "loss_backward_s",
    "max_stage_error",
}
"""The report's figures read off a clock: they differ from run to run."""


@pytest.fixture(scope="module")
def model_and_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan, Path]:
    """The model file and a 2-stage plan (M = 2) from its measured profile."""
    import torch
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest
    from autopipe.modelfile import load_model_file

    folder = tmp_path_factory.mktemp("benchmarking")
    model_py = folder / "tiny.py"
    model_py.write_text(MODEL)
    mf = load_model_file(str(model_py))
    torch.set_num_threads(1)
    options = MeasureOptions(warmup=1, repeat=1)
    prof = profile(mf.build(), mf.inputs(4), options, loss_fn=mf.loss_fn, progress=False)
    p = plan(prof, PlanRequest(gpus=2, batch_size=4, microbatches=2, baselines=False))
    p.save(folder / "plan.json")
    return model_py, p, folder / "plan.json"


def _without_clock_figures(report: dict) -> dict:
    stages = [{k: v for k, v in s.items() if "measured" not in k and "error" not in k}
              for s in report["stages"]]  # fmt: skip
    return {k: v for k, v in report.items() if k not in MEASURED | {"files"}} | {"stages": stages}


def test_bench_model_file_reports_and_writes_what_the_cli_does(
    model_and_plan: tuple[Path, Plan, Path], tmp_path: Path
) -> None:
    model_py, p, plan_path = model_and_plan
    argv = ["bench", str(model_py), "--plan", str(plan_path), "--steps", "1", "--warmup", "0",
            "--no-executor-overhead", "--out", str(tmp_path / "cli"), "--json"]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    cli_report = json.loads(printed.getvalue())
    request = BenchRequest(
        str(model_py), p, out_dir=tmp_path / "api", steps=1, warmup=0, executor_overhead=False
    )
    run = bench_model_file(request)
    # What the API returns is what it wrote, and what the CLI prints.
    assert run.report == json.loads((tmp_path / "api" / "bench.json").read_text())
    assert run.report.keys() == cli_report.keys()
    assert _without_clock_figures(run.report) == _without_clock_figures(cli_report)
    assert run.report["devices"] == ["cpu", "cpu"] and run.report["clock"] == "thread_cpu"
    assert run.result.iteration_predicted_s == cli_report["iteration_predicted_s"] > 0
    names = ["trace.json", "trace_predicted.json", "timeline_compare.png"]
    assert [Path(f).name for f in run.report["files"]] == names
    assert [Path(f).name for f in cli_report["files"]] == names
    assert [f.name for f in run.files] == [*names, "bench.json"]
    assert sorted(f.name for f in (tmp_path / "cli").iterdir()) == sorted(names + ["bench.json"])


def test_bench_model_file_refuses_before_any_step(
    model_and_plan: tuple[Path, Plan, Path], tmp_path: Path
) -> None:
    model_py, p, _ = model_and_plan
    out = tmp_path / "never"
    with pytest.raises(UsageError, match="--devices lists 1 devices but the plan has 2 stages"):
        bench_model_file(BenchRequest(str(model_py), p, out_dir=out, devices=("cpu",)))
    with pytest.raises(UsageError, match="meta device"):
        bench_model_file(BenchRequest(str(model_py), p, out_dir=out, devices=("cpu", "meta")))
    with pytest.raises(UsageError, match="not found"):
        bench_model_file(BenchRequest(str(tmp_path / "none.py"), p, out_dir=out))
    # 10^4 micro-batches: more tasks than a timeline can show; replace_plan derives the
    # new M's actions (a file edited so, keeping the old ones, is refused on load).
    many = replace_plan(p, microbatches=10**4, microbatch_size=1, batch_size=10**4)
    with pytest.raises(UsageError, match="a timeline can show"):
        bench_model_file(BenchRequest(str(model_py), many, out_dir=out))
    assert not out.exists()
    with pytest.raises(UsageError, match=f"^out_dir {model_py} is a file; give a directory$"):
        bench_model_file(BenchRequest(str(model_py), p, out_dir=model_py))
