"""``Plan.actions``: each pipeline rank's ordered actions, the one timeline the ranks execute
(#37). The planner's plans hold their schedule's order, the file keeps it as one string per
rank, a file written before it gets the same order on load, and a hand-edited order is
refused in one line naming the rank and the first action that differs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from autopipe.planner import plan as make_plan
from planner_instances import random_profile

from autopipe.core.plan import Plan, PlanFormatError, StagePlan, load_plan, replace_plan
from autopipe.core.request import PlanRequest
from autopipe.core.schedule_rules import chunk_ranks
from autopipe.core.schedules import rank_orders
from autopipe.core.timeline import Action

CASES = [
    ("gpipe", 3, 1, 5),
    ("1f1b", 3, 1, 5),
    ("interleaved-1f1b", 2, 2, 4),
    ("looped-bfs", 2, 3, 4),
    ("interleaved-zb", 2, 2, 4),
    ("zbv", 2, 2, 4),
    ("dualpipev", 2, 2, 5),
]


def _plan(schedule: str, k: int, v: int, m: int) -> Plan:
    ranks = chunk_ranks(schedule, k, v)
    stages = [
        StagePlan(index=c, device="cpu", units=[f"u{c}"], rank=ranks[c]) for c in range(k * v)
    ]
    return Plan(k, m, 2, 2 * m, stages, schedule=schedule, virtual_stages=v)


@pytest.mark.parametrize(("schedule", "k", "v", "m"), CASES)
def test_a_plans_actions_are_its_schedules_order(schedule: str, k: int, v: int, m: int) -> None:
    plan = _plan(schedule, k, v, m)
    assert plan.actions == rank_orders(schedule, k, v, m)
    assert [len(order) for order in plan.actions] == [
        len(rank_orders(schedule, k, v, m)[r]) for r in range(k)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zbv"])
def test_the_planner_fills_the_actions_of_the_plan_it_makes(schedule: str) -> None:
    made = make_plan(
        random_profile(8, seed=3),
        PlanRequest(gpus=2, batch_size=8, microbatches=4, schedule=schedule, baselines=False),
    )
    assert made.schedule == schedule and made.microbatches == 4
    assert made.actions == rank_orders(schedule, 2, made.virtual_stages, 4)


def test_changing_the_figures_the_order_depends_on_re_derives_it() -> None:
    plan = _plan("1f1b", 2, 1, 4)
    plan.microbatches, plan.batch_size = 2, 4
    assert plan.actions == rank_orders("1f1b", 2, 1, 2)
    plan.schedule = "gpipe"
    assert [" ".join(map(str, o)) for o in plan.actions] == ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"]
    again = replace_plan(plan, microbatches=4, batch_size=8)
    assert again.actions == rank_orders("gpipe", 2, 1, 4)
    assert plan.actions == rank_orders("gpipe", 2, 1, 2)  # the original is left as it was
    # dataclasses.replace too: the actions are no __init__ argument, never carried over.
    other = dataclasses.replace(plan, schedule="1f1b", microbatches=4, batch_size=8)
    assert other.actions == rank_orders("1f1b", 2, 1, 4)
    with pytest.raises(TypeError):
        Plan(2, 4, 2, 8, plan.stages, actions=plan.actions)  # type: ignore[call-arg]


@pytest.mark.parametrize(("schedule", "k", "v", "m"), CASES)
def test_the_actions_round_trip_through_the_file(
    tmp_path: Path, schedule: str, k: int, v: int, m: int
) -> None:
    plan = _plan(schedule, k, v, m)
    path = tmp_path / "plan.json"
    plan.save(path)
    written = json.loads(path.read_text())["actions"]
    # One string per rank in torch's _Action notation: chunk, F/B/I/W, micro-batch.
    assert written == [" ".join(str(a) for a in order) for order in plan.actions]
    assert load_plan(path).actions == plan.actions


def test_the_file_notation_is_torchs() -> None:
    written = _plan("interleaved-zb", 2, 1, 2).to_dict()["actions"]
    assert written == ["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"]


@pytest.mark.parametrize(("schedule", "k", "v", "m"), CASES)
def test_a_file_written_before_the_field_loads_with_the_schedules_order(
    tmp_path: Path, schedule: str, k: int, v: int, m: int
) -> None:
    data = _plan(schedule, k, v, m).to_dict()
    del data["actions"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).actions == rank_orders(schedule, k, v, m)


def test_a_version_1_file_loads_with_the_schedules_order() -> None:
    path = Path(__file__).resolve().parent / "data" / "plan_v1_mesh.json"
    data = json.loads(path.read_text())
    assert data["version"] == 1 and "actions" not in data
    loaded = load_plan(path)
    assert loaded.actions == rank_orders(
        loaded.schedule, loaded.num_stages, loaded.virtual_stages, loaded.microbatches
    )


def _refusal(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFormatError) as info:
        load_plan(path)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_a_hand_edited_order_is_refused_naming_the_rank_and_action(tmp_path: Path) -> None:
    data = _plan("1f1b", 2, 1, 4).to_dict()
    assert data["actions"][1] == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    data["actions"][1] = "1F0 1B0 1F1 1B1 1F3 1B2 1F2 1B3"  # micro-batches 2 and 3 swapped
    text = _refusal(tmp_path, data)
    assert "actions[1] has 1F3 at position 4 where 1f1b with num_stages=2, virtual_stages=1, " in (
        text
    )
    assert "microbatches=4 runs 1F2" in text


def test_a_missing_or_extra_action_or_rank_is_refused(tmp_path: Path) -> None:
    data = _plan("gpipe", 2, 1, 2).to_dict()
    data["actions"][0] = "0F0 0F1 0B0"
    assert "actions[0] has the end at position 3 where gpipe" in _refusal(tmp_path, data)
    data["actions"][0] = "0F0 0F1 0B0 0B1 0B1"
    assert "actions[0] has 0B1 at position 4 where gpipe" in _refusal(tmp_path, data)
    data["actions"] = data["actions"][:1]
    assert "actions lists 1 ranks but gpipe" in _refusal(tmp_path, data)


def test_an_edited_microbatch_count_with_the_old_actions_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """M edited by hand, the actions left as written: refused from the forward count, without
    building the new M's order (a million micro-batches would take seconds)."""
    data = _plan("1f1b", 2, 1, 4).to_dict()
    data.update(microbatches=10**6, microbatch_size=1, batch_size=10**6)
    assert _refusal(tmp_path, data) == (
        f"{tmp_path / 'edited.json'}: actions[0] runs 4 forwards where 1f1b with num_stages=2, "
        "virtual_stages=1, microbatches=1000000 runs 1000000; a plan's actions are its "
        "schedule's order (remove the field to have it derived)"
    )
    del data["actions"]
    data.update(microbatches=8, batch_size=8)
    path = tmp_path / "derived.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).actions == rank_orders("1f1b", 2, 1, 8)


def test_a_schedule_the_stages_cannot_run_is_left_to_the_schedule_rules(tmp_path: Path) -> None:
    """zbv needs V = 2: such a file loads as before, and the rules refuse it where it would
    run or be emitted (``stages-per-rank``), not the actions check."""
    data = _plan("1f1b", 2, 1, 4).to_dict()
    data["schedule"] = "zbv"
    path = tmp_path / "zbv.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).schedule == "zbv"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0F0 0X1", "actions[0] has '0X1'; expected <chunk><F|B|I|W><micro-batch>"),
        ("0F0 0L1", "actions[0] has '0L1'"),  # a loss is no rank action
        (7, "actions[0] is 7; expected a string"),
    ],
)
def test_an_unreadable_action_is_refused(tmp_path: Path, value: object, says: str) -> None:
    data = _plan("gpipe", 2, 1, 2).to_dict()
    data["actions"][0] = value
    assert says in _refusal(tmp_path, data)


def test_the_printed_report_does_not_show_the_actions() -> None:
    plan = _plan("1f1b", 2, 1, 4)
    text = plan.summary_text()
    bare = _plan("1f1b", 2, 1, 4)
    bare.actions = []
    assert text == bare.summary_text()
    assert "1F0" not in text and "actions" not in text


def test_actions_are_instructions() -> None:
    plan = _plan("zbv", 2, 2, 4)
    assert plan.instructions()["actions"] == plan.to_dict()["actions"]
    assert "actions" not in plan.to_dict()["report"]
    assert Action(0, 0, "forward") == plan.actions[0][0]
