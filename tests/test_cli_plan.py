"""autopipe/cli/plan.py: ``autopipe plan`` is flag parsing plus the library's one call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from autopipe.planner import plan
from planner_instances import random_profile

from autopipe.cli import main
from autopipe.core.plan import load_plan
from autopipe.core.request import PlanRequest


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    random_profile(8, 4).save(path)
    return path


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_cli_plans_what_the_library_plans(
    profile_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    code = main(
        ["plan", str(profile_json), "--gpus", "3", "--microbatches", "4", "--schedule", "1f1b",
         "--checkpoint", "never", "--json", str(out), "-q"]
    )  # fmt: skip
    assert code == 0 and capsys.readouterr().out == ""
    cli = load_plan(out)
    api = plan(
        random_profile(8, 4),
        PlanRequest(gpus=3, microbatches=4, schedule="1f1b", checkpoint="never"),
    )
    assert cli.request == api.request
    assert cli.profile == random_profile(8, 4)  # the CLI keeps the profile in the plan
    shipped = cli.to_dict()
    shipped["report"]["profile"] = None
    assert shipped == api.to_dict()


def test_the_table_goes_to_stdout_and_json_to_stdout_alone(
    profile_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(profile_json), "--gpus", "2", "--microbatches", "2"]) == 0
    assert "stage" in capsys.readouterr().out
    assert main(["plan", str(profile_json), "--gpus", "2", "--microbatches", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # only the JSON: the table is not printed
    assert data["num_stages"] == 2 and data["microbatches"] == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "9"], "--gpus 9 is more than the model's 8 units; use at most 8"),
        (["--gpus", "2", "--microbatches", "5"], "--microbatches 5 does not divide the batch size 32"),
        (["--gpus", "2", "--emit-out", "x.py"], "--emit-out names where --emit FORMAT goes: give --emit too"),
        (
            ["--gpus", "2", "--scaling", "--host-throughput", "1.5"],
            "--host-throughput cannot be combined with --scaling",
        ),
        (["--gpus", "4", "--data-parallel", "3"], "--data-parallel 3 does not divide --gpus 4"),
    ],
)  # fmt: skip
def test_flags_that_cannot_be_planned_exit_2_in_one_line(
    profile_json: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(profile_json), *flags]) == 2
    assert message in _err(capsys)


def test_nothing_fits_is_a_failure_exit_1(
    profile_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(profile_json), "--gpus", "2", "--memory", "1MB"]) == 1
    assert "smallest memory per device that fits is" in _err(capsys)
