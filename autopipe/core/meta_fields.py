"""The one reader for ``meta`` keys that became fields: schema v1 files stay readable.

Torch-free. Earlier writers kept figures that code reads back (a plan's mesh table, its
candidates, a profile's loss time ...) under string keys of ``Plan.meta`` /
``Profile.meta``. They are typed fields now; :func:`lift_meta` moves such a key out of
``meta`` into its field when a record is built (a loaded file, or a writer that still hands
it over in ``meta``), so ``meta`` is left holding free-form notes only. A key moves only
into a field still at its default: a value given as a field wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["lift_meta"]


def lift_meta(record: Any, fields: Mapping[str, str]) -> None:
    """Move each ``meta[key]`` of the dataclass instance ``record`` named in ``fields``
    (``{meta key: field name}``) into that field, when the field is at its default. O(keys)."""
    meta = record.meta
    if not meta or not any(key in meta for key in fields):
        return
    defaults = {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(record)
    }
    for key, name in fields.items():
        if key in meta and getattr(record, name) == defaults[name]:
            setattr(record, name, meta.pop(key))
