"""Bad requests are refused in one line (exit 2) before any work, and leave nothing written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_cli_errors import GPT, _err_line

from autopipe import profiling
from autopipe.cli import main


def _saved_profile(tmp_path: Path, units: int = 4, names: list[str] | None = None) -> Path:
    """A hand-made CPU profile at batch size 8: ``names`` (default ``u0``...) or ``units``."""
    from autopipe.core.profile import Profile, UnitProfile

    names = names or [f"u{i}" for i in range(units)]
    units = len(names)
    rows = [UnitProfile(name=n, forward_s=1e-3, backward_s=2e-3) for n in names]
    saved = tmp_path / "profile.json"
    Profile(units=rows, cut_bytes=[1000] * (units - 1), batch_size=8, device="cpu").save(saved)
    return saved


@pytest.mark.parametrize(
    ("flags", "rule"),
    [
        (["--schedule", "zbv", "--virtual-stages", "3", "--gpus", "2"], "stages-per-rank"),
        (["--schedule", "gpipe", "--virtual-stages", "2", "--gpus", "2"], "stages-per-rank"),
        (["--schedule", "1f1b", "--microbatches", "1", "--gpus", "2"], "microbatches-vs-stages"),
    ],
)
def test_schedule_rules_are_refused_before_profiling(
    flags: list[str], rule: str, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    def no_profiling(*_args: Any) -> Any:
        raise AssertionError("profiled a request the schedule rules refuse")

    monkeypatch.setattr(profiling, "profile_model_file", no_profiling)
    assert main(["plan", GPT, *flags]) == 2
    assert _err_line(capsys).startswith(f"autopipe plan: error: {rule}")


def test_a_refused_plan_saves_no_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved_profile(tmp_path)
    out = tmp_path / "again.json"
    # 3 ranks x 2 zbv chunks need 6 units; the profile has 4: refused after reading it.
    argv = ["plan", str(saved), "--gpus", "3", "--schedule", "zbv", "--save-profile", str(out)]
    assert main(argv) == 2
    assert "stages-per-rank" in _err_line(capsys)
    assert not out.exists()
    assert main(["plan", str(saved), "--gpus", "2", "-q", "--save-profile", str(out)]) == 0
    assert out.exists()


@pytest.mark.parametrize("flag", ["--json", "--emit-out"])
def test_plot_folder_naming_another_output_is_refused_up_front(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved_profile(tmp_path)
    same = tmp_path / "out.json"
    argv = ["plan", str(saved), "--gpus", "2", "--emit", "torch", "-q"]
    assert main([*argv, flag, str(same), "--plot", str(same)]) == 2
    line = _err_line(capsys)
    assert flag in line and "--plot" in line
    assert not same.exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--schedule", "interleaved-1f1b", "--virtual-stages", "3"],
        ["--schedule", "looped-bfs", "--virtual-stages", "3"],
        ["--schedule", "interleaved-zb", "--virtual-stages", "4"],
        ["--schedule", "zbv", "--virtual-stages", "2"],
        ["--schedule", "zbv"],
        ["--schedule", "dualpipev"],
    ],
)
def test_more_chunks_than_units_is_exit_2_for_every_schedule(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved_profile(tmp_path)  # 4 units; 3 ranks x V >= 2 chunks need at least 6
    assert main(["plan", str(saved), "--gpus", "3", *flags]) == 2
    line = _err_line(capsys)
    assert "stages-per-rank" in line and "has 4" in line


def _zbv_v1_plan(tmp_path: Path) -> Path:
    """A plan file whose schedule was edited to zbv while it keeps V = 1 (zbv needs 2)."""
    import json

    plan = tmp_path / "plan.json"
    profile = str(_saved_profile(tmp_path))
    assert main(["plan", profile, "--gpus", "2", "-q", "--json", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["schedule"] = "zbv"
    plan.write_text(json.dumps(data))
    return plan


def test_plot_refuses_a_plan_that_breaks_a_rule_and_makes_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _zbv_v1_plan(tmp_path)
    capsys.readouterr()
    out = tmp_path / "plots"
    assert main(["plot", str(plan), "--out", str(out)]) == 2
    line = _err_line(capsys)
    assert str(plan) in line and "stages-per-rank" in line
    assert not out.exists()


def test_explain_says_a_plan_that_breaks_a_rule_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _zbv_v1_plan(tmp_path)
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 2
    line = _err_line(capsys)
    assert "cannot run" in line and "stages-per-rank" in line and str(plan) in line


def test_emit_out_empty_is_refused_and_dash_is_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    import json

    plan = tmp_path / "plan.json"
    assert (
        main(["plan", str(_saved_profile(tmp_path)), "--gpus", "2", "-q", "--json", str(plan)]) == 0
    )
    capsys.readouterr()
    assert main(["emit", str(plan), "torch", "-o", ""]) == 2
    line = _err_line(capsys)
    assert "--out is empty" in line and "directory" not in line
    monkeypatch.chdir(tmp_path)
    assert main(["emit", str(plan), "torch", "-o", "-"]) == 0
    out = capsys.readouterr().out
    json.loads(out)  # the config alone: no "written to -" after it
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("where", ["optimizer", "request.optimizer"])
def test_a_plan_naming_an_unknown_optimizer_is_refused_on_load(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    plan = _zbv_v1_plan(tmp_path)
    data = json.loads(plan.read_text())
    data["schedule"] = "gpipe"  # consistent again
    if where == "optimizer":
        data["optimizer"] = "lion"
    else:
        data["report"]["request"]["optimizer"] = "lion"
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["explain", str(plan)]) == 2
    line = _err_line(capsys)
    assert where in line and "'lion'" in line and "adam" in line and "sgd" in line


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_deeply_nested_json_is_one_line_naming_the_file(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "deep.json"
    nested = "[" * 200_000 + "]" * 200_000
    f.write_text('{"stages": ' + nested + ', "units": ' + nested + ', "version": 1}')
    argv = ["explain", str(f)] if command == "explain" else ["plan", str(f), "--gpus", "2"]
    assert main(argv) == 2
    line = _err_line(capsys)
    assert str(f) in line and "nested too deeply" in line


ODD_NAMES = ["emb\U0001f600", "a\x1b[31mred", "b\nc", 'q"\\x', "tab\there", "del\x7f"]


def test_torchtitan_toml_of_odd_unit_names_reads_back_with_tomllib(tmp_path: Path) -> None:
    import tomllib
    from autopipe.planner import plan
    from autopipe.planner.emit import to_torchtitan

    from autopipe.core.profile import Profile
    from autopipe.core.request import PlanRequest

    profile = Profile.load(_saved_profile(tmp_path, names=ODD_NAMES))
    result = plan(profile, PlanRequest(gpus=2, checkpoint="never"))
    parts = tomllib.loads(to_torchtitan(result))["parallelism"]["module_fqns_per_model_part"]
    assert [n for part in parts for n in part] == ODD_NAMES


def test_control_characters_in_unit_names_are_escaped_in_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = str(_saved_profile(tmp_path, names=ODD_NAMES))
    plan = tmp_path / "plan.json"
    argv = ["plan", saved, "--gpus", "2", "--checkpoint", "never", "--json", str(plan)]
    assert main(argv) == 0
    assert main(["explain", str(plan)]) == 0
    from autopipe.core.profile import Profile
    from autopipe.report import format_profile

    out = capsys.readouterr().out + format_profile(Profile.load(saved))
    assert "\x1b" not in out and "\x7f" not in out and "b\nc" not in out
    assert "a\\x1b[31mred" in out and "b\\nc" in out and "emb\U0001f600" in out


def test_data_parallel_degree_that_does_not_divide_the_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _saved_profile(tmp_path)  # batch 8
    argv = ["plan", str(saved), "--gpus", "32", "--allreduce-bandwidth", "1GB", "-q"]
    assert main([*argv, "--data-parallel", "32", "--batch-size", "16"]) == 2
    line = _err_line(capsys)
    assert line.startswith("autopipe plan: error: --data-parallel 32: D=32 replicas do not")
    assert "(e.g. 1, 2, 4, 8, 16)" in line and "K=" not in line
    assert main([*argv, "--data-parallel", "16"]) == 2  # the profile's batch of 8
    assert "(e.g. 1, 2, 4, 8)" in _err_line(capsys)


def test_data_parallel_degree_refused_before_profiling(
    capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    def no_profiling(*_args: Any) -> Any:
        raise AssertionError("profiled a request the batch size refuses")

    monkeypatch.setattr(profiling, "profile_model_file", no_profiling)
    argv = ["plan", GPT, "--gpus", "4", "--allreduce-bandwidth", "1GB", "--batch-size", "6"]
    assert main([*argv, "--data-parallel", "4"]) == 2
    assert "D=4 replicas do not divide the batch size 6" in _err_line(capsys)
