"""autopipe.core.plan_report: a plan's predictions kept apart from its instructions (#37)."""

from __future__ import annotations

import dataclasses

from autopipe.core.plan import (
    INSTRUCTION_FIELDS,
    PLAN_VERSION,
    STAGE_INSTRUCTION_FIELDS,
    Plan,
    StagePlan,
)
from autopipe.core.plan_records import CandidateRow
from autopipe.core.plan_report import PlanReport, StageReport


def _plan(report: PlanReport | None = None) -> Plan:
    stages = [StagePlan(index=i, device="cpu", units=[f"u{i}"], rank=i) for i in range(2)]
    return Plan(2, 4, 2, 8, stages, report=report or PlanReport())


def test_the_report_holds_every_field_the_instructions_do_not() -> None:
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    report_fields = {f.name for f in dataclasses.fields(PlanReport)}
    assert (
        plan_fields == {*INSTRUCTION_FIELDS, "report"} and len(plan_fields) == 20
    )  # 18 + actions (#37) + trainer (#34)
    assert len(report_fields) == 31 and not plan_fields & report_fields  # + optimizer_s (#34)
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
    assert set(data) == {*INSTRUCTION_FIELDS, "report"} and data["version"] == PLAN_VERSION == 4
    assert data["report"]["iteration_time_s"] == 0.25 and data["report"]["throughput"] == 32.0
    again = Plan.from_dict(data)
    assert again.report == PlanReport(iteration_time_s=0.25, throughput=32.0)
    assert again.instructions() == {k: v for k, v in data.items() if k != "report"}


def test_a_stage_is_its_instructions_and_its_report() -> None:
    """StagePlan: the 7 fields the ranks act on, 3 for people (the planned device's name and
    the ends of ``units``) and ``report``; the 13 predicted figures are StageReport's."""
    stage_fields = {f.name for f in dataclasses.fields(StagePlan)}
    report_fields = {f.name for f in dataclasses.fields(StageReport)}
    people = {"device", "first_module", "last_module"}
    assert stage_fields == {*STAGE_INSTRUCTION_FIELDS, *people, "report"}
    assert len(STAGE_INSTRUCTION_FIELDS) == 7 and len(report_fields) == 13
    assert not stage_fields & report_fields
    assert {"forward_s", "memory_bytes", "parameter_bytes", "reason"} <= report_fields


def test_a_stage_report_field_read_or_set_through_the_stage_is_the_reports() -> None:
    plan = _plan()
    stage = plan.stages[1]
    stage.forward_s, stage.backward_s, stage.send_s = 0.25, 0.5, 0.125
    stage.report.recompute_s = 0.0625
    assert stage.report.forward_s == 0.25 and stage.recompute_s == 0.0625
    assert stage.time_s == stage.report.time_s == 0.9375
    assert "forward_s" not in vars(stage) and StagePlan.forward_s is not None
    data = plan.to_dict()
    assert data["report"]["stages"][1]["forward_s"] == 0.25  # saved in the report
    assert "forward_s" not in data["stages"][1] and "report" not in data["stages"][1]
    again = Plan.from_dict(data)
    assert again.stages[1].report == stage.report and again == plan
    assert again.instructions() == _plan().instructions()  # predictions are not instructions
