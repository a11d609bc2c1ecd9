"""autopipe.core.plan: the Plan's JSON, its derived figures, and validation of loaded plans."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from autopipe.planner import load_plan, plan
from planner_instances import random_profile

from autopipe.core.plan import INSTRUCTION_FIELDS, STAGE_INSTRUCTION_FIELDS, Plan, PlanFormatError
from autopipe.core.plan_records import MeshRow
from autopipe.core.plan_report import PlanReport, StageReport
from autopipe.core.profile import UnitProfile
from autopipe.core.request import PlanRequest
from autopipe.core.trainer_options import TrainerOptions


def test_plan_json_round_trip(tmp_path: Path) -> None:
    p = plan(
        random_profile(10, 1),
        PlanRequest(gpus=3, microbatches="auto", schedule="auto", checkpoint="auto"),
    )
    path = tmp_path / "plan.json"
    p.save(path)
    data = json.loads(path.read_text())
    for key in "version num_stages microbatches microbatch_size batch_size schedule stages".split():
        assert key in data
    assert data["version"] == 4  # the trainer options an instruction field (#34)
    for key in "iteration_time_s bubble_fraction throughput".split():
        assert key in data["report"] and key not in data
    assert set(data["stages"][0]) == {
        *STAGE_INSTRUCTION_FIELDS,
        "device",
        "first_module",
        "last_module",
    } - {"split_backward"}  # only zero-bubble plans record it
    assert [set(s) for s in data["report"]["stages"]] == [
        {f.name for f in dataclasses.fields(StageReport)}
    ] * len(p.stages)
    assert data["report"]["stages"][1]["forward_s"] == p.stages[1].forward_s > 0
    assert load_plan(path) == p
    assert p.speedup == pytest.approx(p.single_device_time_s / p.iteration_time_s)


@pytest.fixture(scope="module")
def four_stages() -> Plan:
    return plan(
        random_profile(10, 3),
        PlanRequest(gpus=4, microbatches=4, schedule="1f1b", checkpoint="always", baselines=False),
    )


def test_derived_figures(four_stages: Plan) -> None:
    p = four_stages
    assert sum(p.balance) == 10 and len(p.balance) == 4
    assert p.boundaries == [sum(p.balance[:i]) for i in range(4)]
    assert p.mesh_shape == (4, 1, 1) and p.world_size == 4
    assert p.host_throughput is None
    for s in p.stages:
        assert s.time_s == pytest.approx(s.forward_s + s.backward_s + s.recompute_s + s.send_s)
    assert repr(p).startswith("<Plan ") and "1f1b, M=4 x 8" in repr(p) and "\n" not in repr(p)


def _edited(p: Plan, edit: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(p.to_dict()))
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(batch_size=33), "batch_size is 33 but microbatches x microbatch_size"),
        (lambda d: d.update(schedule="zb"), "schedule is 'zb'; expected one of gpipe, 1f1b"),
        (lambda d: d.update(shard="all"), "shard is 'all'; expected one of none, optimizer"),
        (lambda d: d.update(optimizer="lion"), "optimizer is 'lion'; expected one of custom"),
        (lambda d: d.update(num_stages=0), "num_stages is 0"),
        (
            lambda d: (d["stages"].pop(), d["report"]["stages"].pop()),
            "lists 3 stages but num_stages x virtual_stages is 4 x 1",
        ),
        (lambda d: d["stages"][2].update(index=5), "stages[2].index is 5; expected 2"),
        (lambda d: d["stages"][1].update(units=[]), "stages[1].units is empty"),
        (lambda d: d["stages"][3].update(rank=7), "stages[3].rank is 7; expected 0..3"),
        (lambda d: d["stages"][3].update(rank=0), "gives the ranks [2, 1, 1, 0] stages"),
        (
            lambda d: d["stages"][1]["units"].__setitem__(0, "layer0"),
            "stages[1].units repeats 'layer0' (already in stages[0])",
        ),
        (
            lambda d: d["stages"][1]["units"].append("extra"),
            "stages[1].unit_parameters lists",
        ),
        (
            lambda d: d["stages"][0].update(checkpoint_granularity="layer"),
            "stages[0].checkpoint_granularity is 'layer'; expected one of stage, unit",
        ),
        (lambda d: d["report"]["request"].update(gpus=0), "request.gpus is 0"),
        (lambda d: d["report"]["request"].update(optimizer="lion"), "request.optimizer is 'lion'"),
        (lambda d: d["report"].update(request=5), "request is not an object"),
    ],
)
def test_a_loaded_plan_that_cannot_be_right_is_one_line(
    four_stages: Plan, edit: Any, message: str
) -> None:
    with pytest.raises(PlanFormatError) as info:
        Plan.from_dict(_edited(four_stages, edit))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_schema_version_and_kind(four_stages: Plan, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_edited(four_stages, lambda d: d.update(version=9))))
    with pytest.raises(PlanFormatError, match=r"p\.json: plan schema version 9 is not supported"):
        load_plan(path)
    with pytest.raises(PlanFormatError, match="not an autopipe plan: no 'stages' key"):
        Plan.from_dict({"units": []})


def test_stages_without_a_rank_are_one_per_rank(four_stages: Plan) -> None:
    def unplaced(d: dict[str, Any]) -> None:
        for s in d["stages"]:
            s["rank"] = -1

    assert [s.rank for s in Plan.from_dict(_edited(four_stages, unplaced)).stages] == [0, 1, 2, 3]


def _earlier_plan(path: Path) -> int | None:
    """The version of a plan file written before version 3 (1: before the Plan / PlanReport
    split of #37; 2: before the stages' predictions moved into the report and ``replicas``
    became ``data_parallel``), None for any other file."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(data, dict) and "stages" in data and data.get("version") in (1, 2):
        return int(data["version"])
    return None


def _as_version_2(data: dict[str, Any]) -> dict[str, Any]:
    """A version-4 plan object in the version-2 layout: each stage's report beside it,
    ``replicas`` and the report's ``data_parallel`` rows under their earlier names, the
    trainer options only in the request (checked to be what it asked)."""
    data = dict(data)
    request = data["report"]["request"]
    from_request = TrainerOptions.from_request(
        PlanRequest.from_dict(request) if request is not None else None
    )
    assert data.pop("trainer") == from_request.to_dict()
    report = dict(data["report"])
    stages = [{**s, **r} for s, r in zip(data["stages"], report.pop("stages"), strict=True)]
    out = {k: v for k, v in data.items() if k != "data_parallel"}
    out.update(stages=stages, replicas=data["data_parallel"], version=2)
    report["data_parallel"] = report.pop("data_parallel_rows")
    out["report"] = report
    return out


def _added_row_fields_as_defaults(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Drop from ``new`` (a mesh report) the mesh-row fields added after ``old`` was written,
    each checked to have loaded as its default."""
    row_defaults = {f.name: f.default for f in dataclasses.fields(MeshRow)}
    for row, before in zip(new["candidates"], old["candidates"], strict=True):
        for key in set(row) - set(before):
            assert row[key] == row_defaults[key], key
            del row[key]


def _added_fields_as_defaults(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Drop from ``new`` (a plan's report, or a v1 plan) the request and profile-unit fields
    added after ``old`` was written, each checked to have loaded as its default."""
    defaults = PlanRequest().to_dict()
    for key in set(new["request"]) - set(old["request"]):
        assert new["request"][key] == defaults[key], key
        del new["request"][key]
    # report and mesh-row figures priced after ``old`` was written (optimizer_s, #34)
    report_defaults = {f.name: f.default for f in dataclasses.fields(PlanReport)}
    for key in set(new) - set(old) - {"request", "profile", "stages"}:
        assert new[key] == report_defaults[key], key
        del new[key]
    if new.get("mesh") and old.get("mesh"):
        _added_row_fields_as_defaults(new["mesh"], old["mesh"])
    unit_defaults = dataclasses.asdict(UnitProfile(name="x"))
    for unit, before in zip(new["profile"]["units"], old["profile"]["units"], strict=True):
        for key in set(unit) - set(before):
            assert unit[key] == unit_defaults[key], key
            del unit[key]


def test_every_earlier_plan_file_still_loads() -> None:
    """Every version-1 and -2 plan file in tests/ and examples/ loads, its predictions in the
    report; the last writers' files of each version (tests/data/plan_v1_mesh.json and
    tests/data/plan_v2_mesh.json, ``autopipe plan`` of examples/mlp.py for 4 H100s with
    ``--data-parallel 2``) read back field for field, now as version 4 (the trainer options
    from their request)."""
    root = Path(__file__).resolve().parents[1]
    files = [
        p for folder in ("tests", "examples") for p in sorted((root / folder).rglob("*.json"))
        if _earlier_plan(p) is not None
    ]  # fmt: skip
    names = {p.name for p in files}
    assert names >= {"plan_v1_meta.json", "plan_v1_mesh.json", "plan_v2_mesh.json"}
    for path in files:
        loaded = load_plan(path)
        assert loaded.version == 4 and loaded.report.iteration_time_s > 0, path.name
        assert loaded.trainer == TrainerOptions.from_request(loaded.request), path.name
        assert all(s.forward_s > 0 and s.report.memory_bytes > 0 for s in loaded.stages)

    path = root / "tests" / "data" / "plan_v2_mesh.json"
    old, new = json.loads(path.read_text()), load_plan(path).to_dict()
    assert set(new) == {*INSTRUCTION_FIELDS, "report"} and new["version"] == 4
    assert new["data_parallel"] == old["replicas"] == 2 and "replicas" not in new
    assert new["report"]["stages"][0]["forward_s"] == old["stages"][0]["forward_s"] > 0
    new = _as_version_2(new)
    _added_fields_as_defaults(new["report"], old["report"])
    assert new == old

    path = root / "tests" / "data" / "plan_v1_mesh.json"
    old, new = json.loads(path.read_text()), _as_version_2(load_plan(path).to_dict())
    assert new["report"]["iteration_time_s"] == old["iteration_time_s"] > 0
    _added_row_fields_as_defaults(new["report"]["mesh"], old["mesh"])
    assert new["report"]["mesh"] == old["mesh"] and new["replicas"] == old["replicas"] == 2
    flat = {**{k: v for k, v in new.items() if k != "report"}, **new["report"]}
    # Each rank's actions, recorded since (#37): the schedule's order, derived on load.
    assert flat.pop("actions") == ["0F0 0B0", "1F0 1B0"] and "actions" not in old
    _added_fields_as_defaults(flat, old)
    assert {**flat, "version": 1} == old


def test_a_version_3_file_without_stage_reports_loads(four_stages: Plan) -> None:
    """A hand-written file may leave the predictions out; stage reports listed must match."""
    data = _edited(four_stages, lambda d: d["report"].pop("stages"))
    assert [s.report.forward_s for s in Plan.from_dict(data).stages] == [0.0] * 4
    data = _edited(four_stages, lambda d: d["report"]["stages"].pop())
    with pytest.raises(PlanFormatError, match=r"report\.stages lists 3 stages but stages lists 4"):
        Plan.from_dict(data)
    data = _edited(four_stages, lambda d: d["report"]["stages"][2].update(forward_s=-1.0))
    with pytest.raises(PlanFormatError, match=r"report\.stages\[2\]\.forward_s"):
        Plan.from_dict(data)
