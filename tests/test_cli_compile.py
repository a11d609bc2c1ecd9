"""``autopipe profile --compile`` and ``autopipe plan --compile`` (autopipe/cli/profile.py,
plan.py): units timed ``torch.compile``'d, plans for compiled stages, and the one line said
when the two do not match (``autopipe.plan`` warns it, the CLI prints it)."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from autopipe.planner.planning import compile_mismatch
from planner_instances import random_profile

import autopipe
from autopipe.cli import main
from autopipe.core.plan import load_plan
from autopipe.core.profile import Profile
from autopipe.core.profile_records import Measurement
from autopipe.core.request import PlanRequest
from autopipe.core.vocabulary import SPLIT_BACKWARD_SCHEDULES


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """``torch.compile`` calls counted, compiled by AOT autograd without inductor's C++
    (seconds per graph on CPU): the CLI's path, not the kernels, is under test."""
    counts: Counter[str] = Counter()
    real = torch.compile
    backend = torch._dynamo.lookup_backend("aot_eager_decomp_partition")

    def counting_compile(model: Any, **kwargs: Any) -> Callable[..., Any]:
        counts["calls"] += 1
        return real(model, **{**kwargs, "backend": backend})

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", counting_compile)
    yield counts
    torch._dynamo.reset()


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_profile_compile_times_the_units_compiled(
    mlp_file: Path, tmp_path: Path, compiles: Counter[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    argv = ["profile", str(mlp_file), "--compile", "--no-cache", "--out", str(out)]
    assert main(argv) == 0
    assert "compiled       units timed torch.compile'd" in capsys.readouterr().out
    p = Profile.load(out)
    assert p.measurement is not None and p.measurement.compile
    assert p.measurement.microbatch_sizes == [8, 2]
    measured = [u for u in p.units if not u.measured_as]
    # Each unit measured compiles once per micro-batch size timed (fixed shapes), and the
    # whole model once: no unit shares a measurement, so it is timed as the reference.
    assert p.measurement.reference and len(measured) == 3
    assert compiles["calls"] == 2 * 3 + 1
    assert all(u.backward_input_s == u.backward_weight_s == 0 for u in p.units)


def test_profile_compile_is_refused_for_a_counted_device(
    mlp_file: Path, compiles: Counter[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profile", str(mlp_file), "--compile", "--device", "a100-80gb"]) == 2
    err = _one_line(capsys)
    assert "--compile applies to measured profiles" in err
    assert compiles["calls"] == 0


def test_plan_compile_on_a_model_file_measures_compiled_and_plans_compiled_stages(
    mlp_file: Path, tmp_path: Path, compiles: Counter[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", str(mlp_file), "--gpus", "2", "--compile", "--no-cache", "--schedule", "auto"]
    assert main([*argv, "--json", str(out), "-q"]) == 0
    assert capsys.readouterr().err == ""  # measured compiled: nothing to warn about
    plan = load_plan(out)
    assert plan.request is not None and plan.request.compile
    assert plan.profile is not None and plan.profile.measurement is not None
    assert plan.profile.measurement.compile and compiles["calls"] > 0
    assert plan.schedule not in SPLIT_BACKWARD_SCHEDULES


def test_plan_compile_on_an_eager_profile_warns_and_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "eager.json"
    random_profile(8, 4).save(path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--gpus", "2", "--compile", "-q", "--json", str(out)]) == 0
    profile = Profile.load(path)  # no model name
    assert _one_line(capsys) == f"autopipe: warning: {compile_mismatch(profile, True)}"
    assert compile_mismatch(profile, True) == (
        "compile: the profile's units were timed eagerly (element-wise ops unfused), so "
        "the plan prices them slower than compiled stages run; profile the model compiled on "
        "a local device (autopipe profile --compile, MeasureOptions(compile=True)) to time "
        "them compiled"
    )
    assert load_plan(out).request.compile  # type: ignore[union-attr]
    argv = ["plan", str(path), "--gpus", "2", "--compile", "--schedule", "zbv"]
    assert main([*argv, "--microbatches", "4"]) == 2
    assert "no-compile-with-zero-bubble" in _one_line(capsys)


def test_plan_compile_for_a_counted_device_warns_that_the_count_is_unfused(
    mlp_file: Path, compiles: Counter[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", str(mlp_file), "--gpus", "2", "--compile", "--device", "a100-80gb", "-q"]
    assert main(argv) == 0
    assert "units were counted (element-wise ops unfused)" in _one_line(capsys)
    assert compiles["calls"] == 0


def test_a_compiled_profile_planned_without_compile_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "compiled.json"
    dataclasses.replace(random_profile(8, 4), measurement=Measurement(compile=True)).save(path)
    assert main(["plan", str(path), "--gpus", "2", "-q"]) == 0
    assert "was timed compiled but the plan is not" in _one_line(capsys)
    assert main(["plan", str(path), "--gpus", "2", "--compile", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_the_api_warns_what_the_cli_says_of_a_compile_mismatch() -> None:
    """``autopipe.plan`` with ``PlanRequest(compile=True)`` on units timed eagerly or counted
    warns the line ``autopipe plan --compile`` prints (:func:`compile_mismatch`, the one
    text), and a profile timed compiled planned without ``compile`` the other; a match says
    nothing. Failed before (only the CLI warned)."""
    eager = random_profile(8, 4)
    counted = dataclasses.replace(eager, mode="analytic")
    compiled = dataclasses.replace(eager, measurement=Measurement(compile=True))
    request = PlanRequest(gpus=2, compile=True)
    for profile, how in ((eager, "timed eagerly"), (counted, "counted")):
        text = compile_mismatch(profile, True)
        assert text is not None and f"units were {how} (element-wise ops unfused)" in text
        with pytest.warns(UserWarning) as caught:
            autopipe.plan(profile, request)
        assert [str(w.message) for w in caught] == [text]
    with pytest.warns(UserWarning, match="was timed compiled but the plan is not"):
        autopipe.plan(compiled, PlanRequest(gpus=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autopipe.plan(compiled, request)
        autopipe.plan(eager, PlanRequest(gpus=2))
    assert compile_mismatch(compiled, True) is compile_mismatch(eager, False) is None
