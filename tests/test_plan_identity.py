"""benchmarks/plan_identity.py's comparison of two trees' outputs (the script itself runs
every example twice, minutes: it stays in benchmarks/; here its verdicts on small folders)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from autopipe.core.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def identity() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_plan_identity", ROOT / "benchmarks" / "plan_identity.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_each_output_is_identical_upgraded_wall_clock_or_different(
    identity: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A version-2 plan file (written by the code before #37's stage split) against the
    same plan saved by this tree is identical once upgraded; a profile differing only in the
    count's wall-clock seconds is named so; anything else differs, and a file on one side
    only is missing."""
    base, new = tmp_path / "base", tmp_path / "new"
    old = ROOT / "tests" / "data" / "plan_v2_mesh.json"
    (base / "cases" / "mlp").mkdir(parents=True)
    shutil.copy(old, base / "cases" / "mlp" / "plan.json")
    (new / "cases" / "mlp").mkdir(parents=True)
    load_plan(old).save(new / "cases" / "mlp" / "plan.json")
    for side in (base, new):
        _write(side / "cases" / "mlp" / "plan.stdout", "autopipe plan: mlp on 2 stages\n")
    _write(base / "cases" / "mlp" / "emit-torch.stdout", "pp 2\n")
    _write(new / "cases" / "mlp" / "emit-torch.stdout", "pp 3\n")
    _write(new / "cases" / "mlp" / "explain.stdout", "why\n")
    for side, seconds in ((base, 1.5), (new, 2.25)):
        counted = {"units": [{"name": "0"}], "counting": {"seconds": seconds, "passes": 2}}
        _write(side / "profiles" / "mlp.json", json.dumps(counted))

    kinds = identity.compare_with_base(base, new)
    assert kinds == {
        "identical": ["cases/mlp/plan.stdout"],
        "upgraded": ["cases/mlp/plan.json"],
        "wall_clock": ["profiles/mlp.json"],
        "content": [],
        "differ": ["cases/mlp/emit-torch.stdout", "cases/mlp/explain.stdout"],
    }
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and "MISSING in base: cases/mlp/explain.stdout" in lines
    assert "DIFFERS: cases/mlp/emit-torch.stdout" in lines
    assert old.read_bytes() != (new / "cases" / "mlp" / "plan.json").read_bytes()


def test_a_plan_differing_in_a_value_is_not_upgraded(identity: ModuleType, tmp_path: Path) -> None:
    old = ROOT / "tests" / "data" / "plan_v2_mesh.json"
    (tmp_path / "base").mkdir()
    shutil.copy(old, tmp_path / "base" / "plan.json")
    changed = load_plan(old)
    changed.stages[0].forward_s *= 1 + 1e-12  # a prediction, not an instruction
    (tmp_path / "new").mkdir()
    changed.save(tmp_path / "new" / "plan.json")
    kinds = identity.compare_with_base(tmp_path / "base", tmp_path / "new")
    assert kinds["differ"] == ["plan.json"] and kinds["upgraded"] == []
