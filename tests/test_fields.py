"""autopipe.core.fields: every loaded number finite and in range, one line naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.core.errors import UsageError
from autopipe.core.fields import (
    LARGEST_PROFILE_VALUE,
    FieldError,
    check_dataclass,
    check_number,
)


@dataclasses.dataclass
class Record:
    name: str
    count: int
    time_s: float
    flag: bool = False
    limit_bytes: int | None = None
    sizes: list[int] = dataclasses.field(default_factory=list)
    shift_s: float = 0.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "units[3].forward_s is nan; expected a finite number"),
        (float("inf"), "units[3].forward_s is inf; expected a finite number"),
        (-0.5, "units[3].forward_s is -0.5; expected a finite number >= 0"),
        ("0.1", "units[3].forward_s is '0.1'; expected a finite number"),
        (True, "units[3].forward_s is True; expected a finite number"),
        (None, "units[3].forward_s is None; expected a finite number"),
    ],
)
def test_bad_numbers_are_one_line_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(FieldError) as info:
        check_number("units[3].forward_s", value)
    assert str(info.value) == message and "\n" not in message
    assert info.value.field == "units[3].forward_s"
    assert isinstance(info.value, UsageError) and isinstance(info.value, ValueError)


def test_integers_take_integral_floats_only() -> None:
    assert check_number("n", 64.0, integer=True) == 64
    assert type(check_number("n", 64.0, integer=True)) is int
    with pytest.raises(FieldError, match=r"^n is 64.5; expected an integer$"):
        check_number("n", 64.5, integer=True)
    with pytest.raises(FieldError, match=r"^n is 0; expected an integer in \[1, 10\]$"):
        check_number("n", 0, integer=True, minimum=1, maximum=10)


def test_huge_integers_print_short() -> None:
    with pytest.raises(FieldError) as info:
        check_number("batch_size", 10**308, integer=True, maximum=LARGEST_PROFILE_VALUE)
    assert str(info.value) == "batch_size is 1.000e+308; expected an integer in [0, 1e+30]"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_check_number_accepts_exactly_the_finite_numbers_in_range(value: float) -> None:
    ok = math.isfinite(value) and 0 <= value <= LARGEST_PROFILE_VALUE
    try:
        got = check_number("x", value, maximum=LARGEST_PROFILE_VALUE)
    except FieldError as exc:
        assert not ok and str(exc).startswith("x is ") and "\n" not in str(exc)
    else:
        assert ok and got == value


def test_check_dataclass_normalises_and_passes_good_records() -> None:
    r = Record(name="a", count=3.0, time_s=1, sizes=[1, 2.0], limit_bytes=None)  # type: ignore[arg-type]
    check_dataclass(r)
    assert r.count == 3 and type(r.count) is int and r.sizes == [1, 2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": 5}, "units[0].name is 5; expected a string"),
        ({"count": -1}, "units[0].count is -1; expected an integer >= 0"),
        ({"time_s": float("nan")}, "units[0].time_s is nan; expected a finite number"),
        ({"flag": 1}, "units[0].flag is 1; expected true or false"),
        ({"limit_bytes": -2}, "units[0].limit_bytes is -2; expected an integer >= 0"),
        ({"sizes": 4}, "units[0].sizes is int; expected a list"),
        ({"sizes": [1, -3]}, "units[0].sizes[1] is -3; expected an integer >= 0"),
    ],
)
def test_check_dataclass_names_the_first_bad_field(change: dict, message: str) -> None:
    r = dataclasses.replace(Record(name="a", count=1, time_s=0.5), **change)
    with pytest.raises(FieldError) as info:
        check_dataclass(r, prefix="units[0].")
    assert str(info.value) == message


def test_bounds_of_their_own_and_a_maximum() -> None:
    r = Record(name="a", count=1, time_s=0.5, shift_s=-2.0)
    check_dataclass(r, bounds={"shift_s": (-10, 10)})  # a field may go below 0 when told
    with pytest.raises(FieldError, match=r"^shift_s is -2.0; expected a finite number >= 0$"):
        check_dataclass(r)
    with pytest.raises(FieldError, match=r"^count is 5; expected an integer in \[0, 4\]$"):
        check_dataclass(Record(name="a", count=5, time_s=0.5), maximum=4)
