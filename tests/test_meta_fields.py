"""autopipe.core.meta_fields: old ``meta`` keys move into their typed fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autopipe.core.meta_fields import lift_meta


@dataclass
class Record:
    candidates: list[int] = field(default_factory=list)
    loss_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


FIELDS = {"candidates": "candidates", "loss_forward_s": "loss_s"}


def test_a_key_moves_into_a_field_at_its_default() -> None:
    r = Record(meta={"candidates": [1, 2], "loss_forward_s": 0.5, "note": "free-form"})
    lift_meta(r, FIELDS)
    assert r.candidates == [1, 2] and r.loss_s == 0.5
    assert r.meta == {"note": "free-form"}  # only free-form notes are left


def test_a_value_given_as_a_field_wins_and_the_key_stays() -> None:
    r = Record(candidates=[7], meta={"candidates": [1, 2], "loss_forward_s": 0.5})
    lift_meta(r, FIELDS)
    assert r.candidates == [7] and r.loss_s == 0.5
    assert r.meta == {"candidates": [1, 2]}


def test_nothing_to_lift_leaves_the_record_alone() -> None:
    r = Record(meta={"note": 1})
    lift_meta(r, FIELDS)
    assert r == Record(meta={"note": 1})
    empty = Record()
    lift_meta(empty, FIELDS)
    assert empty == Record()
