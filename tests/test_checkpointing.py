"""autopipe/core/checkpointing.py: a re-materialization mode as one flag per stage."""

from __future__ import annotations

import pytest

from autopipe.core.checkpointing import check_checkpoint_mode, stage_checkpoints
from autopipe.core.vocabulary import CHECKPOINT_MODES


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("never", [False, False, False, False]),
        ("always", [True, True, True, True]),
        ("except_last", [True, True, True, False]),
        ("auto", [False, True, False, True]),  # the plan's own choice
    ],
)
def test_one_flag_per_stage(mode: str, expected: list[bool]) -> None:
    assert stage_checkpoints(mode, [0, 1, False, True]) == expected


def test_a_single_stage_and_unknown_modes() -> None:
    assert stage_checkpoints("except_last", [True]) == [False]
    assert stage_checkpoints("auto", []) == []
    for mode in CHECKPOINT_MODES:
        check_checkpoint_mode(mode)
    with pytest.raises(ValueError) as info:
        stage_checkpoints("sometimes", [True])
    assert str(info.value) == (
        "checkpoint is not one of 'never', 'always', 'except_last', 'auto': got 'sometimes'"
    )
