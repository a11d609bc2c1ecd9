"""Lazily imported package attributes (``autopipe.core.lazy``, PEP 562)."""

from __future__ import annotations

import types

import pytest

from autopipe.core.lazy import lazy_attributes


def test_lazy_attributes_import_once_and_list_themselves() -> None:
    module = types.ModuleType("fake")
    module.__all__ = ["eager"]
    module.eager = 1
    getattr_, dir_ = lazy_attributes(
        "fake", {"join": "os.path", "sep": ("os", "sep")}, module.__dict__
    )
    module.__getattr__ = getattr_
    import os

    assert module.join is os.path.join and module.sep == os.sep
    assert module.__dict__["join"] is os.path.join  # kept: later lookups skip __getattr__
    assert dir_() == ["eager", "join", "sep"]
    with pytest.raises(AttributeError, match="module 'fake' has no attribute 'nope'"):
        module.nope  # noqa: B018
