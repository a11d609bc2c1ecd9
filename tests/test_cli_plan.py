"""autopipe/cli/plan.py: ``autopipe plan`` is flag parsing plus the library's one call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from autopipe.planner import plan
from autopipe.planner.trainer import fp8_refusal
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


def test_fp8_on_a_counted_profile_plans_a_faster_step_and_says_what_it_does_not_price(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--precision fp8`` on a profile from autopipe's own profiler (a GPT counted for an
    H100) prices its weight matmuls at the FP8 peak: a faster predicted step than bf16. The
    profiler does not count the FP8 casts (they depend on the compiler's fusions), so a
    warning line says they are not priced; a profile without ``linear_forward_flops`` (written
    before the profiler recorded them) is refused in one line (exit 2), not planned as bf16."""
    import dataclasses

    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.options import AnalyticOptions
    from profiler_models import load_example

    gpt = load_example("gpt")
    cfg = gpt.GPTConfig(vocab_size=32000, seq_len=1024, d_model=2048, n_layer=4, n_head=16)
    with __import__("torch").device("meta"):
        model = gpt.GPT(cfg)
    p = profile_analytic(
        model, gpt.example_inputs(8, cfg), "h100", AnalyticOptions(), loss_fn=gpt.loss_fn
    )
    assert all(u.linear_forward_flops > 0 for u in p.units if u.name.startswith("blocks."))
    path = tmp_path / "gpt.json"
    p.save(path)
    step_s = {}
    for precision in ("bf16", "fp8"):
        out = tmp_path / f"{precision}.json"
        argv = ["plan", str(path), "--gpus", "2", "--precision", precision, "-q"]
        assert main([*argv, "--json", str(out)]) == 0
        err = capsys.readouterr().err.strip()
        if precision == "fp8":
            assert err == (
                "autopipe: warning: --precision fp8: this profile has no FP8 cast bytes "
                "(fp8_cast_*_bytes), so the casts to FP8 are not priced: the step is predicted "
                "faster than it runs (docs/cost-model.md, FP8)"
            )
        else:
            assert err == ""
        step_s[precision] = load_plan(out).iteration_time_s
    assert step_s["fp8"] < 0.9 * step_s["bf16"]
    old = tmp_path / "old.json"
    without = dataclasses.replace(
        p, units=[dataclasses.replace(u, linear_forward_flops=0.0) for u in p.units]
    )
    without.save(old)
    assert main(["plan", str(old), "--gpus", "2", "--precision", "fp8", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopipe plan: error: --precision fp8: ") and len(err.splitlines()) == 1
    assert "records no weight-matmul FLOPs" in err
    # the planner's reason, word for word (the Python API's RuleViolation gives the same)
    assert err.endswith(f"{old} {fp8_refusal(without)}") and fp8_refusal(p) is None
    assert main(["plan", str(old), "--gpus", "2", "-q"]) == 0  # bf16 plans it as before
