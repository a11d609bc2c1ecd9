"""The README's main job, end to end: profile examples/gpt.py, plan 8 stages, read the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autopipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
PLAN_KEYS = {
    "version",
    "num_stages",
    "microbatches",
    "microbatch_size",
    "batch_size",
    "schedule",
    "stages",
}
REPORT_KEYS = {"iteration_time_s", "bubble_fraction", "throughput"}
"""Under ``"report"`` since version 2 (#37)."""
STAGE_KEYS = {"index", "device", "units", "checkpoint"}
STAGE_REPORT_KEYS = {"forward_s", "backward_s", "memory_bytes"}
"""Under ``"report"``, as ``report.stages``, since version 3 (#37)."""


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("e2e")
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOPIPE_CACHE_DIR", str(out / "cache"))  # measure for real, not from a cache
    try:
        code = main(
            [
                "plan",
                GPT,
                "--gpus",
                "8",
                "--json",
                str(out / "plan.json"),
                "--save-profile",
                str(out / "profile.json"),
                "-q",
            ]
        )
    finally:
        mp.undo()
    assert code == 0
    return out / "plan.json", out / "profile.json"


def test_plan_json_has_eight_stages_and_the_documented_keys(gpt_plan: tuple[Path, Path]) -> None:
    data = json.loads(gpt_plan[0].read_text())
    assert PLAN_KEYS <= data.keys() and REPORT_KEYS <= data["report"].keys()
    predicted = data["report"].pop("stages")
    data = {**data, **data.pop("report")}
    assert data["num_stages"] == 8 and len(data["stages"]) == len(predicted) == 8
    for i, (stage, figures) in enumerate(zip(data["stages"], predicted, strict=True)):
        assert STAGE_KEYS <= stage.keys() and STAGE_REPORT_KEYS <= figures.keys()
        assert stage["index"] == i and stage["units"] and figures["forward_s"] > 0
    units = [u for s in data["stages"] for u in s["units"]]
    assert units[0] == "tok_emb" and units[-1] == "head" and len(units) == len(set(units))
    assert data["microbatches"] * data["microbatch_size"] == data["batch_size"]
    assert 0 <= data["bubble_fraction"] < 1
    assert data["throughput"] == pytest.approx(data["batch_size"] / data["iteration_time_s"])


def test_planned_split_beats_naive_splits_on_gpt(gpt_plan: tuple[Path, Path]) -> None:
    """Issue 4's acceptance on the measured profile: >= 15% below uniform, below the others."""
    data = json.loads(gpt_plan[0].read_text())["report"]
    base = data["baselines"]
    assert data["iteration_time_s"] <= 0.85 * base["uniform"]["iteration_time_s"]
    for name in ("parameters", "greedy-time"):
        assert data["iteration_time_s"] <= base[name]["iteration_time_s"]


def test_replan_from_saved_profile_and_explain(
    gpt_plan: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, profile = gpt_plan
    assert main(["plan", str(profile), "--gpus", "4", "--microbatches", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_stages"] == 4 and data["microbatches"] == 8
    plan_path = tmp_path / "p4.json"
    plan_path.write_text(json.dumps(data))
    assert main(["explain", str(plan_path)]) == 0
    text = capsys.readouterr().out
    assert "Bottleneck: stage" in text and "M >= 4K" in text


def test_too_many_gpus_is_a_usage_error(
    gpt_plan: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, profile = gpt_plan
    assert main(["plan", str(profile), "--gpus", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "more than the model's" in err


def test_memory_too_small_is_a_failure_naming_the_minimum(
    gpt_plan: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, profile = gpt_plan
    assert main(["plan", str(profile), "--gpus", "2", "--memory", "1MiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smallest memory per device" in err


def test_python_api_profile_plan_parallelize_matches_unpipelined() -> None:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import mlp
    finally:
        sys.path.pop(0)
    from autopipe.profiler.options import MeasureOptions

    import autopipe

    model = mlp.mlp((32, 64, 64, 64, 8))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    profile = autopipe.profile(model, x, MeasureOptions(repeat=1, warmup=0), progress=False)
    plan = autopipe.plan(profile, autopipe.PlanRequest(gpus=3, microbatches=4))
    pipe = autopipe.parallelize(model, x, plan=plan)
    assert pipe.plan is plan
    pipe(x).square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)


def test_devices_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "--json"]) == 0
    names = {d["name"] for d in json.loads(capsys.readouterr().out)}
    assert {"A100-80GB", "H100-SXM-80GB", "MI300X-192GB"} <= names


def test_plot_redraws_all_four_from_the_plan_json_alone(
    gpt_plan: tuple[Path, Path], tmp_path: Path
) -> None:
    """`autopipe plan --json` embeds the profile, so `autopipe plot PLAN.json` needs nothing else."""
    assert main(["plot", str(gpt_plan[0]), "--out", str(tmp_path), "-q"]) == 0
    for name in ("timeline", "bubble", "balance", "scaling"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
