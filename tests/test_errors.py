"""The one error hierarchy (``autopipe/core/errors.py``): every error autopipe raises on purpose
is a ``UsageError`` (exit 2) or a ``Failure`` (exit 1), and the CLI maps them so."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autopipe.core.errors import AutopipeError, Failure, UsageError

ROOT = Path(__file__).resolve().parents[1]


def _direct_children() -> set[str]:
    """The name of every class whose own bases name ``AutopipeError``."""
    found = set()
    for folder in ("autopipe", "profiler", "planner", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id == "AutopipeError" for b in node.bases
                ):
                    found.add(node.name)
    return found


def test_every_error_is_a_usage_error_or_a_failure() -> None:
    assert _direct_children() == {"UsageError", "Failure"}


@pytest.mark.parametrize(
    ("module", "name", "kind"),
    [
        ("autopipe.core.plan", "PlanFormatError", UsageError),
        ("autopipe.core.catalog", "DeviceListError", UsageError),
        ("autopipe.modelfile", "ModelFileError", UsageError),
        ("autopipe.planner", "PlanningError", Failure),
        ("autopipe.planner", "RuleViolation", UsageError),  # a request torch would refuse
        ("autopipe.planner.emit_common", "EmitError", UsageError),
        ("autopipe.profiler.analytic", "AnalyticProfileError", UsageError),
        ("autopipe.runtime.distributed.pipeline", "ScheduleRuleError", UsageError),
    ],
)
def test_the_kind_of_each_error(module: str, name: str, kind: type[AutopipeError]) -> None:
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, kind) and issubclass(cls, ValueError)  # the builtin base is kept


def test_a_model_that_cannot_be_profiled_is_a_usage_error() -> None:
    from autopipe.profiler.measure import ProfilingError

    assert issubclass(ProfilingError, UsageError) and issubclass(ProfilingError, RuntimeError)


def test_the_cli_maps_the_kinds_to_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A planning failure exits 1, a malformed file 2; both one line without a class name."""
    from autopipe.cli import main
    from autopipe.core.profile import Profile, UnitProfile

    units = [UnitProfile(name=f"u{i}", forward_s=1e-3, backward_s=2e-3, parameter_bytes=10**9)
             for i in range(2)]  # fmt: skip
    saved = tmp_path / "profile.json"
    Profile(units=units, cut_bytes=[1000], batch_size=8, device="cpu").save(saved)
    assert main(["plan", str(saved), "--gpus", "2", "--memory", "1GiB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopipe plan: error: ") and "Error:" not in err, err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", str(bad), "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopipe plan: error: ") and "Error:" not in err, err
