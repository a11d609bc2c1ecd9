"""autopipe.core.plan_report: a plan's predictions kept apart from its instructions (#37)."""

from __future__ import annotations

import dataclasses

from autopipe.core.plan import INSTRUCTION_FIELDS, Plan, StagePlan
from autopipe.core.plan_records import CandidateRow
from autopipe.core.plan_report import PlanReport


def _plan(report: PlanReport | None = None) -> Plan:
    stages = [StagePlan(index=i, device="cpu", units=[f"u{i}"], rank=i) for i in range(2)]
    return Plan(2, 4, 2, 8, stages, report=report or PlanReport())


def test_the_report_holds_every_field_the_instructions_do_not() -> None:
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    report_fields = {f.name for f in dataclasses.fields(PlanReport)}
    assert (
        plan_fields == {*INSTRUCTION_FIELDS, "report"} and len(plan_fields) == 19
    )  # 18 + actions (#37)
    assert len(report_fields) == 30 and not plan_fields & report_fields
    assert {"iteration_time_s", "request", "notes", "profile", "mesh"} <= report_fields


def test_a_report_field_read_or_set_through_the_plan_is_the_reports() -> None:
    plan = _plan(PlanReport(iteration_time_s=0.25, notes=["why"]))
    assert plan.iteration_time_s == plan.report.iteration_time_s == 0.25
    plan.bubble_fraction = 0.125
    plan.notes.append("and why not")
    assert plan.report.bubble_fraction == 0.125 and plan.report.notes == ["why", "and why not"]
    assert "bubble_fraction" not in vars(plan)  # kept once, in the report
    assert Plan.iteration_time_s is not None  # the class attribute is the accessor itself


def test_meta_keys_of_earlier_writers_move_into_the_report_fields() -> None:
    row = {"schedule": "1f1b", "virtual_stages": 1, "microbatches": 4, "iteration_time_s": 1.0}
    report = PlanReport(meta={"bottleneck_s": 0.5, "candidates": [row], "frontier": 3})
    assert report.bottleneck_s == 0.5 and report.meta == {"frontier": 3}
    assert isinstance(report.candidates[0], CandidateRow)
    assert report.candidates[0].iteration_time_s == 1.0
    plan = _plan(PlanReport(meta={"granularity": "module"}))  # a plan field's old meta key
    assert plan.granularity == "module" and plan.report.meta == {}


def test_the_saved_report_is_one_object_beside_the_instructions() -> None:
    data = _plan(PlanReport(iteration_time_s=0.25, throughput=32.0)).to_dict()
    assert set(data) == {*INSTRUCTION_FIELDS, "report"} and data["version"] == 2
    assert data["report"]["iteration_time_s"] == 0.25 and data["report"]["throughput"] == 32.0
    again = Plan.from_dict(data)
    assert again.report == PlanReport(iteration_time_s=0.25, throughput=32.0)
    assert again.instructions() == {k: v for k, v in data.items() if k != "report"}
