"""Checks for the values in saved profiles and plans. Torch-free (the planner uses it).

A loaded file is plain JSON: any number may be negative, NaN, infinite, a string or a bool,
and the cost model would happily turn a -10 GiB stage into one that "fits" or a NaN time
into an OverflowError far from the file. :func:`check_dataclass` checks every field of a
dataclass instance against its annotation (``int``, ``float``, ``str``, ``bool``, lists and
``X | None``) and a lower bound, and names the first bad field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from autopipe.core.errors import UsageError

LARGEST_PROFILE_VALUE = 1e30
"""The largest number a profile may hold (seconds, bytes, FLOPs, counts, the batch size):
far beyond any real model (10^30 FLOPs is a trillion-parameter model over 10^17 samples),
and small enough that the planner's sums and products of such values (by batch ratios up to
10^24, micro-batch counts, ranks, bytes per parameter) stay finite in float64, so a
hand-edited 1e308 is refused on load instead of overflowing into infinite times."""


class FieldError(UsageError, ValueError):
    """One field of a loaded profile or plan has a value it must not have.

    ``field`` is the field's path inside the file, e.g. ``units[3].forward_s``.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


def check_number(
    field: str, value: Any, *, integer: bool = False, minimum: float = 0, maximum: float = math.inf
) -> int | float:
    """``value`` if it is a finite number in ``[minimum, maximum]`` (an ``int`` when
    ``integer``; an integral float such as ``64.0`` is taken as 64), else :class:`FieldError`."""
    kind = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(field, f"is {value!r}; expected {kind}")
    shown = _shown(value)
    if not math.isfinite(value):
        raise FieldError(field, f"is {shown}; expected {kind}")
    if integer and isinstance(value, float) and not value.is_integer():
        raise FieldError(field, f"is {shown}; expected {kind}")
    if not minimum <= value <= maximum:
        bound = f">= {minimum:g}" if maximum == math.inf else f"in [{minimum:g}, {maximum:g}]"
        raise FieldError(field, f"is {shown}; expected {kind} {bound}")
    return int(value) if integer else value


def _shown(value: int | float) -> str:
    """``value`` for an error line: ``repr``, but an integer of more than 16 digits in
    ``1.000e+308`` form (a hand-edited 10^308 would otherwise print 309 digits)."""
    digits = str(abs(value)) if isinstance(value, int) else ""
    if len(digits) <= 16:
        return repr(value)
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


def _check_value(field: str, annotation: str, value: Any, minimum: float, maximum: float) -> Any:
    optional = annotation.endswith(" | None")
    if optional:
        if value is None:
            return None
        annotation = annotation.removesuffix(" | None")
    if annotation == "int":
        return check_number(field, value, integer=True, minimum=minimum, maximum=maximum)
    if annotation == "float":
        return check_number(field, value, minimum=minimum, maximum=maximum)
    if annotation == "bool":
        if not isinstance(value, bool):
            raise FieldError(field, f"is {value!r}; expected true or false")
        return value
    if annotation == "str":
        if not isinstance(value, str):
            raise FieldError(field, f"is {value!r}; expected a string")
        return value
    if annotation.startswith("list["):
        if not isinstance(value, list):
            raise FieldError(field, f"is {type(value).__name__}; expected a list")
        item = annotation.removeprefix("list[").removesuffix("]")
        if item in ("int", "float", "str", "bool"):
            return [
                _check_value(f"{field}[{i}]", item, v, minimum, maximum)
                for i, v in enumerate(value)
            ]
        return value  # lists of records: the caller checks each record
    if annotation.startswith("dict["):
        if not isinstance(value, dict):
            raise FieldError(field, f"is {type(value).__name__}; expected an object")
    return value


def check_dataclass(
    record: Any,
    prefix: str = "",
    bounds: Mapping[str, tuple[float, float]] | None = None,
    maximum: float = math.inf,
) -> None:
    """Check (and normalise, e.g. ``64.0`` -> ``64`` for ``int`` fields) every field of the
    dataclass instance ``record`` against its annotation; numbers must be finite and at
    least 0 and at most ``maximum`` unless ``bounds`` gives ``{name: (minimum, maximum)}``
    (a bound of its own for that field). ``prefix`` names the
    record in the error, e.g. ``"units[3]."``. Raises :class:`FieldError`."""
    bounds = bounds or {}
    for f in dataclasses.fields(record):
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        low, high = bounds.get(f.name, (0, maximum))
        value = _check_value(f"{prefix}{f.name}", annotation, getattr(record, f.name), low, high)
        setattr(record, f.name, value)
