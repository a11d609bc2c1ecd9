"""autopipe.core.plan: the Plan's JSON, its derived figures, and validation of loaded plans."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from autopipe.planner import load_plan, plan
from planner_instances import random_profile

from autopipe.core.plan import INSTRUCTION_FIELDS, Plan, PlanFormatError
from autopipe.core.profile import UnitProfile
from autopipe.core.request import PlanRequest


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
    assert data["version"] == 2  # the predictions are the report's (#37)
    for key in "iteration_time_s bubble_fraction throughput".split():
        assert key in data["report"] and key not in data
    for key in (
        "index",
        "device",
        "units",
        "forward_s",
        "backward_s",
        "memory_bytes",
        "checkpoint",
    ):
        assert key in data["stages"][0]
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
        (lambda d: d["stages"].pop(), "lists 3 stages but num_stages x virtual_stages is 4 x 1"),
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


def _version_1_plan(path: Path) -> bool:
    """Whether ``path`` is a plan file written before the Plan / PlanReport split (#37)."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "stages" in data and data.get("version") == 1


def test_every_version_1_plan_file_still_loads() -> None:
    """Every version-1 plan file in tests/ and examples/ (the report's keys at the top level)
    loads, its predictions in the report; the last version-1 writer's file
    (tests/data/plan_v1_mesh.json, ``autopipe plan`` of examples/mlp.py for 4 H100s with
    ``--data-parallel 2``) reads back field for field, now as version 2."""
    root = Path(__file__).resolve().parents[1]
    files = [
        p for folder in ("tests", "examples") for p in sorted((root / folder).rglob("*.json"))
        if _version_1_plan(p)
    ]  # fmt: skip
    assert {p.name for p in files} >= {"plan_v1_meta.json", "plan_v1_mesh.json"}
    for path in files:
        loaded = load_plan(path)
        assert loaded.version == 2 and loaded.report.iteration_time_s > 0, path.name
    path = root / "tests" / "data" / "plan_v1_mesh.json"
    old, new = json.loads(path.read_text()), load_plan(path).to_dict()
    assert set(new) == {*INSTRUCTION_FIELDS, "report"} and new["version"] == 2
    assert new["report"]["iteration_time_s"] == old["iteration_time_s"] > 0
    assert new["report"]["mesh"] == old["mesh"] and new["replicas"] == old["replicas"] == 2
    flat = {**{k: v for k, v in new.items() if k != "report"}, **new["report"]}
    # Each rank's actions, recorded since (#37): the schedule's order, derived on load.
    assert flat.pop("actions") == ["0F0 0B0", "1F0 1B0"] and "actions" not in old
    # A request field added after the file was written loads as its default.
    added = set(flat["request"]) - set(old["request"])
    defaults = PlanRequest().to_dict()
    for key in added:
        assert flat["request"][key] == defaults[key], key
        del flat["request"][key]
    # A profile unit field added after the file was written (optional in v1) loads as its
    # default too.
    unit_defaults = dataclasses.asdict(UnitProfile(name="x"))
    for unit, before in zip(flat["profile"]["units"], old["profile"]["units"], strict=True):
        for key in set(unit) - set(before):
            assert unit[key] == unit_defaults[key], key
            del unit[key]
    assert {**flat, "version": 1} == old
