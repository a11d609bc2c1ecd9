"""Bad values and hostile conditions across the CLI and the JSON files (issue 11): nothing
hangs, nothing is lost, nothing wrong is accepted. One case (or a few) per item; the
torchrun fault drills are in test_faults_drills.py, GPipe's torchgpipe behaviour in
test_faults_gpipe.py.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopipe.cli import main
from autopipe.core.plan import Plan, PlanFormatError
from autopipe.core.profile import (
    Profile,
    ProfileFormatError,
    UnitProfile,
    atomic_write_json,
)

ROOT = Path(__file__).resolve().parents[1]

SMALL_MODEL = """\
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0))
"""


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line on stderr (no traceback)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def _model_file(tmp_path: Path, text: str = SMALL_MODEL, name: str = "m.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _profile_dict() -> dict[str, Any]:
    units = [
        UnitProfile(
            name=f"u{i}",
            forward_s=1e-3,
            backward_s=2e-3,
            parameter_bytes=4000,
            activation_bytes=800,
            output_bytes=400,
        )
        for i in range(4)
    ]
    return Profile(units=units, cut_bytes=[400] * 3, batch_size=8, device="cpu").to_dict()


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))  # NaN stays NaN: json writes it, as a broken tool would
    return path


def _plan_dict(tmp_path: Path) -> dict[str, Any]:
    from autopipe.planner import plan

    from autopipe.core.request import PlanRequest

    return plan(Profile.from_dict(_profile_dict()), PlanRequest(gpus=2, microbatches=4)).to_dict()


# -- item 4: temp files --------------------------------------------------------------------


def test_a_planted_symlink_does_not_redirect_the_write(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "plan.json"
    # The old temp name was predictable: .NAME.tmp<PID>.
    (tmp_path / f".plan.json.tmp{os.getpid()}").symlink_to(victim)
    atomic_write_json(target, {"ok": 1})
    assert victim.read_text() == "keep me"
    assert json.loads(target.read_text()) == {"ok": 1} and not target.is_symlink()


def test_a_failed_write_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "plan.json"
    atomic_write_json(target, {"version": 1})

    def disk_full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    for _ in range(3):  # one more leftover per retry, before
        with pytest.raises(OSError, match="No space"):
            atomic_write_json(target, {"version": 2})
    monkeypatch.undo()
    with pytest.raises(TypeError):
        atomic_write_json(target, {"not json": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    assert json.loads(target.read_text()) == {"version": 1}


def test_concurrent_writers_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "cache.json"
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        for j in range(50):
            try:
                atomic_write_json(target, {"writer": i, "write": j})
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(json.loads(target.read_text())) == {"writer", "write"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # mkstemp's 0600 is not kept


# -- item 5: values in profiles, plans and the cache -----------------------------------------

_UNIT_NUMBERS = [
    f.name for f in __import__("dataclasses").fields(UnitProfile) if f.type in ("int", "float")
]
_BAD = [-1, -1e-9, math.nan, math.inf, -math.inf, "1", True, None]
_SIGNED_UNIT_NUMBERS = {"full_recompute_extra_s"}
"""The unit numbers that may be negative (what a re-run costs beyond its forward)."""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    unit=st.integers(0, 3),
    field=st.sampled_from(_UNIT_NUMBERS),
    bad=st.sampled_from(_BAD),
)
def test_every_bad_unit_number_is_refused_naming_the_field(unit: int, field: str, bad: Any) -> None:
    data = _profile_dict()
    data["units"][unit][field] = bad
    negative = isinstance(bad, float | int) and not isinstance(bad, bool) and -1e30 <= bad < 0
    if field in _SIGNED_UNIT_NUMBERS and negative:
        Profile.from_dict(data)  # a re-run cheaper than its forward is a legitimate value
        return
    with pytest.raises(ProfileFormatError, match=rf"units\[{unit}\]\.{field} is "):
        Profile.from_dict(data)


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(
        ["batch_size", "bytes_per_parameter", "input_bytes", "total_forward_s", "cut_bytes.1"]
    ),
    bad=st.sampled_from([0, -3, math.nan, math.inf, 2.5, "8", False]),
)
def test_every_bad_profile_number_is_refused(field: str, bad: Any) -> None:
    data = _profile_dict()
    name, _, index = field.partition(".")
    if index:
        data[name][int(index)] = bad
    else:
        data[name] = bad
    zero_ok = field in ("input_bytes", "total_forward_s", "cut_bytes.1")
    fractional_ok = field == "total_forward_s"
    if (bad == 0 and not isinstance(bad, bool) and zero_ok) or (bad == 2.5 and fractional_ok):
        Profile.from_dict(data)  # these are legitimate values of those fields
        return
    with pytest.raises(ProfileFormatError, match=rf"{name}(\[{index}\])? is "):
        Profile.from_dict(data)


_PROFILE_NUMBERS = [
    *(f"units.1.{name}" for name in _UNIT_NUMBERS),
    *(
        f.name
        for f in __import__("dataclasses").fields(Profile)
        if f.type in ("int", "float") and f.name != "version"
    ),
    "cut_bytes.1",
]


def _set_profile_number(data: dict[str, Any], field: str, value: Any) -> None:
    """``data[...]`` at ``units.1.forward_s``, ``cut_bytes.1`` or ``batch_size`` := value."""
    *path, last = field.split(".")
    where: Any = data
    for key in path:
        where = where[int(key)] if key.isdigit() else where[key]
    where[int(last) if last.isdigit() else last] = value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(_PROFILE_NUMBERS),
    huge=st.sampled_from([1e308, 10**308, 1.0000001e30, 2 * 10**30, 1e31]),
)
def test_a_profile_number_beyond_1e30_is_refused_naming_it(field: str, huge: float) -> None:
    data = _profile_dict()
    _set_profile_number(data, field, huge)
    named = re.escape(field).replace(r"\.1\.", r"\[1\]\.").replace(r"\.1", r"\[1\]")
    with pytest.raises(ProfileFormatError, match=rf"^{named} is \S+; expected .* 1e\+30\]$"):
        Profile.from_dict(data)


def test_a_profile_of_1e30_values_plans_without_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1e30 (the largest accepted) in every number of a profile: the planner's arithmetic
    stays finite, even at a batch of 10^18 from a profile of 8 (a 1e308 gave 13 numpy
    overflow warnings and an infinite plan)."""
    data = _profile_dict()
    for field in _PROFILE_NUMBERS:
        if not field.endswith(("overhead_s", "tp_compute_fraction", "batch_size")):
            _set_profile_number(
                data, field, 10**30 if "bytes" in field or "count" in field else 1e30
            )
    saved = tmp_path / "profile.json"
    saved.write_text(json.dumps(data))
    import warnings

    for schedule in ("gpipe", "interleaved-1f1b", "zbv"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for batch in ([], ["--batch-size", str(10**18)]):
                argv = ["plan", str(saved), "--gpus", "2", "--schedule", schedule, "--json"]
                assert main([*argv, *batch]) == 0
                out, err = capsys.readouterr()
                assert err == ""
                assert 0 < json.loads(out)["report"]["iteration_time_s"] < math.inf


def test_a_forward_of_1e308_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _profile_dict()
    data["units"][1]["forward_s"] = 1e308
    saved = tmp_path / "profile.json"
    saved.write_text(json.dumps(data))
    assert main(["plan", str(saved), "--gpus", "2"]) == 2
    assert _error(capsys) == (
        f"autopipe plan: error: {saved}: units[1].forward_s is 1e+308; expected a finite "
        "number in [0, 1e+30]"
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    field=st.sampled_from(
        [
            "num_stages",
            "microbatches",
            "batch_size",
            "iteration_time_s",
            "throughput",
            "stages.0.forward_s",
            "stages.1.memory_bytes",
            "stages.1.send_s",
        ]
    ),
    bad=st.sampled_from([-1, math.nan, math.inf, "2", None]),
)
def test_every_bad_plan_number_is_refused(tmp_path: Path, field: str, bad: Any) -> None:
    data = _plan_dict(tmp_path)
    parts = field.split(".")
    if len(parts) == 3:  # a stage's prediction is the report's too (version 3)
        data["report"]["stages"][int(parts[1])][parts[2]] = bad
    else:  # a prediction is the report's (#37)
        (data["report"] if field in data["report"] else data)[field] = bad
    with pytest.raises(PlanFormatError, match=r" is "):
        Plan.from_dict(data)


def _mutations() -> list[tuple[str, Any, str]]:
    def set_unit(i: int, key: str, value: Any) -> Any:
        return lambda d: d["units"][i].__setitem__(key, value)

    def zero_times(d: dict) -> None:
        for u in d["units"]:
            u["forward_s"] = u["backward_s"] = 0.0

    return [
        ("negative-size", set_unit(1, "parameter_bytes", -10 * 2**30), "units[1].parameter_bytes"),
        ("negative-time", set_unit(0, "forward_s", -1.0), "units[0].forward_s"),
        ("nan-time", set_unit(2, "backward_s", math.nan), "units[2].backward_s"),
        ("all-zero-times", zero_times, "are 0 for every unit"),
        ("nan-cut", lambda d: d["cut_bytes"].__setitem__(1, math.nan), "cut_bytes[1]"),
        ("negative-cut", lambda d: d["cut_bytes"].__setitem__(0, -5), "cut_bytes[0]"),
        ("duplicate-name", set_unit(3, "name", "u1"), "units[3].name 'u1' repeats units[1]"),
        ("bytes-per-parameter-0", lambda d: d.__setitem__("bytes_per_parameter", 0), "bytes_per_parameter"),
        ("batch-size-0", lambda d: d.__setitem__("batch_size", 0), "batch_size is 0"),
        ("batch-size-text", lambda d: d.__setitem__("batch_size", "8"), "batch_size is '8'"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("mutate", "field"), [m[1:] for m in _mutations()], ids=[m[0] for m in _mutations()]
)
def test_bad_profile_values_exit_2_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, field: str
) -> None:
    """Before: -10 GiB 'fit' in 1 KiB, a negative time planned 'inf samples/s' (both exit 0),
    NaN ended in an OverflowError (exit 1)."""
    data = _profile_dict()
    mutate(data)
    path = _write(tmp_path / "profile.json", data)
    assert main(["plan", str(path), "--gpus", "2", "--memory", "1KiB"]) == 2
    line = _error(capsys)
    assert line.startswith(f"autopipe plan: error: {path}: ") and field in line, line


def test_a_bad_cache_entry_is_re_measured_with_a_warning(tmp_path: Path) -> None:
    import torch
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions
    from torch import nn

    torch.manual_seed(0)
    model, inputs = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(4, 4)
    options = MeasureOptions(warmup=0, repeat=1)
    profile(model, inputs, options, cache=True, cache_dir=tmp_path, progress=False)
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data["units"][0]["forward_s"] = -1.0  # well-formed JSON, impossible value
    entry.write_text(json.dumps(data))
    with pytest.warns(
        UserWarning, match=r"ignoring unusable cached profile .*units\[0\]\.forward_s"
    ):
        again = profile(model, inputs, options, cache=True, cache_dir=tmp_path, progress=False)
    assert again.units[0].forward_s >= 0
    assert json.loads(entry.read_text())["units"][0]["forward_s"] >= 0  # the entry is rewritten


# -- item 6: an output path must not destroy an input -------------------------------------


def test_outputs_naming_an_input_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_file(tmp_path)
    saved = _write(tmp_path / "profile.json", _profile_dict())
    source, profile_text = model.read_text(), saved.read_text()
    cases = [
        (["profile", str(model), "--out", str(model)], "--out"),
        (["profile", str(model), "--json", str(model)], "--json"),
        (["plan", f"{model}:build_model", "--gpus", "2", "--json", str(model)], "--json"),
        (["plan", str(saved), "--gpus", "2", "--json", str(saved)], "--json"),
        (["plan", str(model), "--gpus", "2", "--save-profile", str(model)], "--save-profile"),
    ]
    for argv, flag in cases:
        assert main(argv) == 2, argv
        line = _error(capsys)
        assert f"{flag} " in line and "is the input" in line and "would destroy it" in line, line
    assert (
        main(["plan", str(saved), "--gpus", "2", "--json", "a.json", "--save-profile", "./a.json"])
        == 2
    )
    assert "--json and --save-profile both write" in _error(capsys)
    assert model.read_text() == source and saved.read_text() == profile_text


def test_unwritable_output_is_refused_before_profiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # build_model would fail: the refusal must come first.
    model = _model_file(tmp_path, "def build_model():\n    raise RuntimeError('built')\n\n"
                        "def example_inputs(batch_size=8):\n    return None\n")  # fmt: skip
    assert main(["plan", str(model), "--gpus", "2", "--json", "/sys/plan.json"]) == 2
    assert "--json /sys/plan.json: cannot write in /sys" in _error(capsys)
    assert main(["profile", str(model), "--out", "/sys/no/such/p.json"]) == 2
    assert "cannot write in /sys" in _error(capsys)


# -- item 7: the data's batch size against the plan ------------------------------------------

IGNORES_BATCH = SMALL_MODEL.replace("torch.randn(batch_size, 4,", "torch.randn(8, 4,")


def test_inputs_that_ignore_batch_size_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_file(tmp_path, IGNORES_BATCH)
    assert main(["plan", str(model), "--gpus", "2", "--batch-size", "64", "-q"]) == 2
    assert "example_inputs(64) returned a batch of 8 (dim 0), not 64" in _error(capsys)
    plan = tmp_path / "plan.json"
    data = _plan_dict(tmp_path)
    data.update(batch_size=64, microbatch_size=16)
    _write(plan, data)
    assert main(["bench", str(model), "--plan", str(plan), "--out", str(tmp_path / "b")]) == 2
    assert "returned a batch of 8 (dim 0), not 64" in _error(capsys)


def test_plan_with_batch_size_0_is_not_benchmarked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _plan_dict(tmp_path)
    data["batch_size"] = 0
    plan = _write(tmp_path / "plan.json", data)
    model = _model_file(tmp_path)
    assert main(["bench", str(model), "--plan", str(plan), "--out", str(tmp_path / "b")]) == 2
    assert f"{plan}: batch_size is 0" in _error(capsys)
    assert not (tmp_path / "b").exists()


# -- item 8: numeric flags ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "M", "--gpus", "2", "--memory", "1e400"], "too large"),
        (["plan", "M", "--gpus", "2", "--memory", "0.5"], "less than one byte"),
        (["plan", "M", "--gpus", "2", "--allreduce-bandwidth", "inf", "--data-parallel", "2"], "not a bandwidth"),
        (["run", "M", "--plan", "P", "--timeout", "0"], "expected a timeout in seconds > 0"),
        (["run", "M", "--plan", "P", "--timeout", "nan"], "expected a timeout in seconds > 0"),
        (["run", "M", "--plan", "P", "--lr", "-1"], "expected a learning rate > 0"),
        (["run", "M", "--plan", "P", "--timeout", "1e10"], "the maximum is 604800"),
        (["run", "M", "--plan", "P", "--timeout", "1e15"], "the maximum is 604800"),
        (["plan", "M", "--gpus", "2", "--bytes-per-parameter", "1e300", "--memory", "1GiB"], "the maximum is 1e+06"),
        (["plan", "M", "--gpus", "2", "--host-throughput", "1e-300"], "the minimum is 0.001"),
    ],
    ids=["memory-1e400", "memory-0.5", "bandwidth-inf", "timeout-0", "timeout-nan", "lr-negative",
         "timeout-1e10", "timeout-1e15", "bytes-per-parameter-1e300", "host-throughput-1e-300"],
)  # fmt: skip
def test_out_of_range_flags_are_one_line_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.strip().splitlines()[-1], err


def _cli(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI in a subprocess, so that a hang fails the test instead of stalling the suite."""
    return subprocess.run(
        [sys.executable, "-m", "autopipe.cli", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout_s,
    )


def test_a_huge_batch_size_plans_in_seconds(tmp_path: Path) -> None:
    """Before: divisors were found by scanning 1..B, so B = 10^12 never finished."""
    saved = _write(tmp_path / "profile.json", _profile_dict())
    out = _cli(
        "plan", str(saved), "--gpus", "2", "--batch-size", str(10**12), "--json", timeout_s=30
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batch_size"] == 10**12


def test_infeasible_memory_names_a_real_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _write(tmp_path / "profile.json", _profile_dict())
    assert main(["plan", str(saved), "--gpus", "2", "--memory", "1KiB"]) == 1
    line = _error(capsys)
    assert "fits in 1.0 KiB per device" in line and "0.0 MiB" not in line
    assert re.search(r"the smallest memory per device that fits is \d+\.\d KiB", line), line


def test_plot_and_bench_refuse_ten_thousand_micro_batches_at_once(tmp_path: Path) -> None:
    data = _plan_dict(tmp_path)
    del data["actions"]  # derived for the new M on load (kept, they would be refused)
    data.update(batch_size=10**4, microbatches=10**4, microbatch_size=1)
    plan = _write(tmp_path / "plan.json", data)
    for argv in (
        ["plot", str(plan), "--out", str(tmp_path / "plots")],
        ["bench", str(_model_file(tmp_path)), "--plan", str(plan), "--out", str(tmp_path / "b")],
    ):
        out = _cli(*argv, timeout_s=30)
        assert out.returncode == 2, out.stderr
        assert "40,000 tasks, more than the 20,000 a timeline can show" in out.stderr
        assert "--microbatches 5000 or fewer" in out.stderr and len(out.stderr.splitlines()) == 1


def test_plan_keeps_the_plan_but_skips_plots_it_cannot_draw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _write(tmp_path / "profile.json", _profile_dict())
    argv = ["plan", str(saved), "--gpus", "2", "--batch-size", str(10**6), "--microbatches"]
    out = tmp_path / "plan.json"
    assert main([*argv, "10000", "--plot", str(tmp_path / "plots"), "--json", str(out), "-q"]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopipe: warning: --plot skipped: the plan's 2 stages x 10000"), err
    assert json.loads(out.read_text())["microbatches"] == 10000
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_stages": 0, "stages": [], "report.stages": []}, "num_stages is 0"),
        ({"microbatches": 0}, "microbatches is 0"),
        ({"iteration_time_s": math.nan}, "iteration_time_s is nan"),
    ],
    ids=["0-stages", "M-0", "nan-time"],
)
def test_plot_and_bench_refuse_impossible_plans_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, field: str
) -> None:
    data = _plan_dict(tmp_path)
    for key, value in copy.deepcopy(change).items():  # a prediction is the report's (#37)
        if key.startswith("report."):
            data["report"][key.removeprefix("report.")] = value
        else:
            (data if key in data else data["report"])[key] = value
    plan = _write(tmp_path / "plan.json", data)
    assert main(["plot", str(plan), "--out", str(tmp_path / "plots")]) == 2
    assert f"{plan}: {field}" in _error(capsys)
    assert main(["bench", str(_model_file(tmp_path)), "--plan", str(plan)]) == 2
    assert f"{plan}: {field}" in _error(capsys)
    assert not (tmp_path / "plots").exists()


# -- also: exit codes, progress bars, sys.exit, strict JSON ---------------------------------

WRONG_SHAPES = SMALL_MODEL.replace("torch.randn(batch_size, 4,", "torch.randn(batch_size, 5,")

DATA_DEPENDENT = """\
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent: neither fx nor export follows it
            return self.b(h) + h
        return h


def build_model():
    return Branchy()


def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4)
"""


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        (WRONG_SHAPES, [], "the model failed on example_inputs(8): RuntimeError: mat1 and mat2"),
        (WRONG_SHAPES, ["--device", "a100-80gb"], "analytic mode runs the model on the meta device, and 0 failed there in forward"),
        (DATA_DEPENDENT, [], "cannot trace Branchy"),
        (DATA_DEPENDENT, ["--device", "a100-80gb"], "cannot trace Branchy"),
        (SMALL_MODEL, ["--gpus", "4", "--data-parallel", "3", "--allreduce-bandwidth", "1GB"], "--data-parallel 3 does not divide --gpus 4"),
    ],
    ids=["shapes-measured", "shapes-analytic", "control-flow-measured", "control-flow-analytic", "data-parallel-3"],
)  # fmt: skip
def test_bad_input_is_exit_2_everywhere(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    extra: list[str],
    message: str,
) -> None:
    model = _model_file(tmp_path, text)
    argv = ["plan", str(model), "--gpus", "2", *extra, "-q", "--no-cache"]
    assert main(argv) == 2
    assert message in _error(capsys)


def test_wrong_shapes_are_exit_2_in_bench_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from distributed_cases import make_plan

    plan = tmp_path / "plan.json"
    make_plan([["0", "1", "2"], ["3", "4"]], 2, 8).save(plan)  # the model's 5 units
    model = _model_file(tmp_path, WRONG_SHAPES)
    assert main(["bench", str(model), "--plan", str(plan), "--out", str(tmp_path / "b"), "-q"]) == 2
    assert "the model failed on example_inputs(8): RuntimeError: mat1 and mat2" in _error(capsys)


FAILS_WHILE_TIMED = SMALL_MODEL.replace(
    "def build_model():",
    """calls = [0]


class Flaky(nn.Module):
    def forward(self, x):
        calls[0] += 1
        if calls[0] > 6:  # after tracing and a few timing rounds: mid progress bar
            raise RuntimeError("flaky layer")
        return x


def build_model():""",
).replace("nn.Linear(8, 4))", "nn.Linear(8, 4), Flaky())")


def test_an_error_starts_its_own_line_after_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model_file(tmp_path, FAILS_WHILE_TIMED)
    # --no-share: the whole model is then also timed in one piece, eagerly, which is where
    # the flaky layer runs (the traced units hold none of its Python).
    assert main(["plan", str(model), "--gpus", "2", "--no-cache", "--no-share"]) == 2
    err = capsys.readouterr().err
    assert "profiling" in err  # the bar was drawn
    assert any(line.startswith("autopipe plan: error: ") for line in err.split("\n")), repr(err)
    assert "RuntimeError: flaky layer" in err


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("import sys\nsys.exit(3)\n", "importing"),
        ("import sys\n\ndef build_model():\n    sys.exit('bye')\n\ndef example_inputs(b=2):\n    return None\n", "the factory"),
    ],
    ids=["at-import", "in-factory"],
)  # fmt: skip
def test_sys_exit_in_a_model_file_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    model = _model_file(tmp_path, text)
    assert main(["plan", str(model), "--gpus", "2"]) == 2  # before: exit 3, no message
    line = _error(capsys)
    assert where in line and "called sys.exit(" in line and "must define functions" in line


def test_json_output_is_strict(tmp_path: Path) -> None:
    from autopipe.cli.common import emit_json

    target = tmp_path / "steps.json"
    emit_json({"steps": [{"loss": math.nan}, {"loss": math.inf}, {"loss": 1.5}]}, str(target))
    text = target.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"steps": [{"loss": None}, {"loss": None}, {"loss": 1.5}]}


# -- item 1, the mechanism (the drills check the behaviour) ---------------------------------


def test_sub_groups_get_the_world_timeout() -> None:
    """``new_group`` without ``timeout=`` waits torch's 30-minute default; the runtime passes
    the world's, read back even when the world was not made by init_distributed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from autopipe.runtime.distributed.process import group_timeout

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7)
    )
    try:
        assert group_timeout() == timedelta(seconds=7)
        group = dist.new_group([0], timeout=group_timeout())
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()


# -- item 3, the comparison (the drill checks the behaviour) ---------------------------------


def test_fingerprints_name_what_differs(tmp_path: Path) -> None:
    from autopipe.runtime.distributed.agree import mismatch, model_fingerprint, plan_fingerprint
    from torch import nn

    plan = Plan.from_dict(_plan_dict(tmp_path))
    other = Plan.from_dict(_plan_dict(tmp_path))
    other.stages[0].checkpoint = True
    small, wide = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 8))
    same = {"plan": plan_fingerprint(plan), "model": model_fingerprint(small)}
    assert mismatch([same, copy.deepcopy(same)]) is None
    assert mismatch([same, {**same, "plan": plan_fingerprint(other)}]) == (
        "the ranks loaded different plans: stages[0].checkpoint is True on rank 1 but False "
        "on rank 0; give every rank the same --plan file"
    )
    line = mismatch([same, same, {**same, "model": model_fingerprint(wide)}])
    assert line is not None and line.startswith(
        "the ranks built different models: Sequential with 2 tensors, 40 elements (#"
    )
    assert "on rank 2 but Sequential with 2 tensors, 20 elements" in line


# -- autopipe run --save DIR: refused before any work ---------------------------------------


@pytest.mark.parametrize(
    ("save", "message"),
    [
        ("", "--save needs a directory name, got ''"),
        (".", "--save .: name the directory to create or replace"),
    ],
    ids=["empty", "dot"],
)
def test_save_without_a_directory_name_is_refused(
    capsys: pytest.CaptureFixture[str], save: str, message: str
) -> None:
    """Before, ``--save ''`` trained and saved nothing, exit 0."""
    assert main(["run", "M.py", "--plan", "P.json", "--save", save]) == 2
    assert f"autopipe run: error: {message}" in _error(capsys)


def test_save_refuses_a_folder_of_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The new checkpoint replaces DIR whole: a folder holding the model file is refused."""
    model = _model_file(tmp_path)
    argv = ["run", str(model), "--plan", "P.json", "--save", str(tmp_path)]
    assert main(argv) == 2
    line = _error(capsys)
    assert f"--save {tmp_path}: holds 'm.py', no part of a checkpoint" in line, line
    assert model.read_text() == SMALL_MODEL


def test_save_refuses_a_symlink_or_someone_elses_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / ".metadata").write_text("victim's")
    link = tmp_path / "ckpt"
    link.symlink_to(victim)
    assert main(["run", "M.py", "--plan", "P.json", "--save", str(link)]) == 2
    assert f"--save {link}: is a symbolic link" in _error(capsys)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(victim).st_uid + 1)
    assert main(["run", "M.py", "--plan", "P.json", "--save", str(victim)]) == 2
    assert f"--save {victim}: belongs to uid {os.stat(victim).st_uid}, not to this user" in (
        _error(capsys)
    )
    assert (victim / ".metadata").read_text() == "victim's"


# -- special files: written through, never replaced -------------------------------------------


def test_a_fifo_is_written_through_not_replaced(tmp_path: Path) -> None:
    """Before, ``emit -o FIFO`` replaced the FIFO with a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_json(fifo, {"ok": 1})
    reader.join(10)
    assert json.loads(b"".join(received)) == {"ok": 1}
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_character_device_is_written_through_not_replaced(tmp_path: Path) -> None:
    """``--json /dev/null`` as root used to replace /dev/null with a regular file; here a
    copy of the null device (made with mknod, where allowed) takes the old behaviour's
    damage, and /dev/null itself is written to after it."""
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod is not allowed here")
    atomic_write_json(null, {"ok": 1})
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    link = tmp_path / "out.json"  # a link to the device: both stay
    link.symlink_to(null)
    atomic_write_json(link, {"ok": 2})
    assert link.is_symlink() and stat.S_ISCHR(os.lstat(null).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "out.json"]
    atomic_write_json("/dev/null", {"ok": 3})
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_symlink_to_a_file_stays_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real.name)
    atomic_write_json(link, {"ok": 1})
    assert link.is_symlink() and os.readlink(link) == real.name
    assert json.loads(real.read_text()) == {"ok": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


# -- huge batch sizes: divisor search bounded by what is kept ---------------------------------


@settings(max_examples=300, deadline=None, derandomize=True)
@given(n=st.integers(1, 5000), up_to=st.one_of(st.none(), st.integers(1, 6000)))
def test_divisors_match_brute_force(n: int, up_to: int | None) -> None:
    from autopipe.planner.search import divisors

    expected = [d for d in range(1, n + 1) if n % d == 0 and (up_to is None or d <= up_to)]
    assert divisors(n, up_to=up_to) == expected


def test_divisors_of_a_huge_batch_size_are_bounded_by_what_is_kept() -> None:
    """Before, every caller found all divisors of B by trial division up to sqrt(B):
    10^12 steps for B = 10^24, though only those up to 4096 were kept."""
    from autopipe.planner.search import MAX_AUTO_MICROBATCHES, divisor_hint, divisors

    n = 10**24
    kept = divisors(n, up_to=MAX_AUTO_MICROBATCHES)
    assert kept == [d for d in range(1, MAX_AUTO_MICROBATCHES + 1) if n % d == 0]
    assert divisor_hint(n, 3) == "pick a divisor (e.g. 1, 2, 4, 5, 8, 10)"


def test_a_batch_size_of_10_to_the_24_plans(tmp_path: Path) -> None:
    saved = _write(tmp_path / "profile.json", _profile_dict())
    out = _cli(
        "plan", str(saved), "--gpus", "2", "--batch-size", str(10**24), "--json", timeout_s=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batch_size"] == 10**24
    data = _profile_dict()
    data["batch_size"] = 10**18  # the profile's own batch size, no --batch-size
    out = _cli("plan", str(_write(saved, data)), "--gpus", "2", "--json", timeout_s=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["batch_size"] == 10**18


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MASTER_PORT": "99999"}, "[rank 1] autopipe run: error: MASTER_PORT=99999 is not a TCP port (1 to 65535)"),
        ({"WORLD_SIZE": "abc"}, "[rank 1] autopipe run: error: WORLD_SIZE='abc' is not an integer"),
        ({"RANK": "5"}, "[rank 5] autopipe run: error: RANK=5 is not a rank of a world of 2 (0 to 1)"),
    ],
    ids=["port-99999", "world-abc", "rank-5-of-2"],
)  # fmt: skip
def test_bad_launch_variables_are_usage_errors_at_once(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    """Before, each waited out --timeout at connect time (or raised inside c10d)."""
    import time

    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_cases import fault_files, free_port, rank_env

    model, plan = fault_files(tmp_path)
    launch = dict(os.environ, **rank_env(1, 2, free_port()), OMP_NUM_THREADS="1")
    launch.update(env)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "autopipe", "run", str(model), "--plan", str(plan),
         "--timeout", "60"],
        env=launch, capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == message
    assert time.monotonic() - start < 60  # not the --timeout


@pytest.mark.parametrize("flag", ["--json", "--save-profile", "--emit-out"])
def test_a_named_pipe_output_is_refused_in_one_line(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``--json FIFO`` with no reader blocked forever at the end of the plan."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    emit = ["--emit", "torch"] if flag == "--emit-out" else []
    argv = ["plan", str(ROOT / "examples" / "gpt.py"), "--gpus", "2", *emit, flag, str(fifo)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} {fifo} is a named pipe" in err


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        (["plan", "{fifo}", "--gpus", "2"], "is a named pipe, not a model file"),
        (["plan", "{dir}", "--gpus", "2"], "is a directory, not a profile file"),
        (["explain", "{fifo}"], "is a named pipe, not a plan file"),
        (["emit", "{dir}", "torch"], "is a directory, not a plan file"),
    ],
)
def test_an_input_that_exists_but_is_no_file_is_named_not_missing(
    tmp_path: Path, argv: list[str], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a named pipe or a folder given as the model, profile or plan was "file not
    found", which sends the user looking for a file that is there."""
    fifo, folder = tmp_path / "pipe", tmp_path / "plan.json"
    os.mkfifo(fifo)
    folder.mkdir()
    args = [a.format(fifo=fifo, dir=folder) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and what in err and "not found" not in err, err


def test_a_named_pipe_device_spec_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``--device-spec FIFO`` with no writer blocked forever reading it."""
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    assert (
        main(["plan", str(ROOT / "examples" / "gpt.py"), "--gpus", "2", "--device-spec", str(fifo)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a named pipe, not a file" in err
