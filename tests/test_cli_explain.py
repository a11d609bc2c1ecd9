"""autopipe/cli/explain.py: ``autopipe explain PLAN.json``, text or JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from autopipe.planner import plan
from planner_instances import random_profile

from autopipe.cli import main
from autopipe.core.request import PlanRequest
from autopipe.explain import explain


@pytest.fixture
def saved(tmp_path: Path):  # type: ignore[no-untyped-def]
    p = plan(random_profile(6, 2), PlanRequest(gpus=2, microbatches=4, schedule="1f1b"))
    path = tmp_path / "plan.json"
    p.save(path)
    return p, path


def test_text_and_json_are_the_librarys_explanation(
    saved, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    p, path = saved
    assert main(["explain", str(path)]) == 0
    assert capsys.readouterr().out == explain(p) + "\n"
    assert main(["explain", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["explanation"] == explain(p).splitlines()
    assert data["plan"] == json.loads(json.dumps(p.to_dict()))
    assert main(["explain", str(path), "-q"]) == 0
    assert capsys.readouterr().out == ""


def test_a_plan_torch_would_refuse_is_not_explained(
    saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    p, _ = saved
    bad = tmp_path / "bad.json"
    dataclasses.replace(p, microbatches=1, microbatch_size=32).save(bad)
    assert main(["explain", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "bad.json: the plan cannot run: microbatches-vs-stages: Schedule1F1B needs at least as "
        "many micro-batches as pipeline stages, M >= 2 (2 ranks x 1), got M=1"
    )
    assert main(["explain", str(tmp_path / "missing.json")]) == 2
    assert "plan file not found" in capsys.readouterr().err


def test_a_plan_edited_off_its_mesh_record_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``explain`` printed the mesh record's stale figures and notes (pp 1 x dp 2
    x tp 2 ...) for a plan edited to another mesh."""
    from test_planner_mesh import tiny_profile

    p = plan(tiny_profile(n_blocks=6), PlanRequest(gpus=4, tensor_parallel=2, data_parallel=2))
    assert p.mesh_shape == (1, 2, 2)
    path = tmp_path / "mesh.json"
    p.save(path)
    assert main(["explain", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    data["shard"] = "optimizer"  # a mesh the run rules accept (mesh_problems), not the record's
    path.write_text(json.dumps(data))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "mesh record chose pp 1 x dp 2 x tp 2 (shard none) of 4 GPUs but the plan is " in err
    assert "pp 1 x dp 2 x tp 2 (shard optimizer)" in err
