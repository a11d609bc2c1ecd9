"""autopipe.core.vocabulary: the name lists agree with each other."""

from __future__ import annotations

from autopipe.core.vocabulary import (
    CHECKPOINT_MODES,
    DEFAULT_CHECKPOINT,
    EMBEDDING_TP_STYLES,
    FRAMEWORK_DEFAULTS,
    FRAMEWORK_LABELS,
    LOOP_SCHEDULES,
    PLAN_SCHEDULES,
    SINGLE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    TORCH_CLASSES,
    TP_STYLES,
    V_SHAPE_SCHEDULES,
)


def test_every_schedule_is_in_exactly_one_family_simplest_first() -> None:
    families = SINGLE_SCHEDULES + LOOP_SCHEDULES + V_SHAPE_SCHEDULES
    assert sorted(families) == sorted(PLAN_SCHEDULES) and len(set(families)) == len(families)
    assert PLAN_SCHEDULES[:2] == ("gpipe", "1f1b")  # the planner breaks ties in this order
    assert set(SPLIT_BACKWARD_SCHEDULES) <= set(PLAN_SCHEDULES) - set(SINGLE_SCHEDULES)
    assert all(name.startswith("Schedule") for name in TORCH_CLASSES.values())
    assert len(set(TORCH_CLASSES.values())) == len(TORCH_CLASSES)


def test_defaults_are_among_their_choices() -> None:
    assert DEFAULT_CHECKPOINT in CHECKPOINT_MODES
    assert set(FRAMEWORK_LABELS) == set(FRAMEWORK_DEFAULTS)
    assert set(EMBEDDING_TP_STYLES) <= set(TP_STYLES)
