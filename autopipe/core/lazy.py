"""Lazily imported package attributes (PEP 562), the one helper every package uses for them.

A package that names functions from heavy modules (torch, matplotlib) imports them only when
they are first used, so ``import autopipe`` and ``import autopipe.planner`` stay torch-free and
fast. Imports nothing from autopipe, so any layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

LazyTable = Mapping[str, "str | tuple[str, str]"]
"""Attribute name -> the module that defines it under the same name, or ``(module, attr)``."""


def lazy_attributes(
    package: str, table: LazyTable, namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose globals are ``namespace``.

    ``__getattr__(name)`` imports the module ``table[name]`` names, returns the attribute and
    keeps it in ``namespace``, so the import runs once and later lookups are plain globals
    (Python calls a module ``__getattr__`` only for names it does not have). An unknown name
    raises AttributeError as for any module. ``__dir__`` lists the package's ``__all__`` (or,
    without one, its globals) together with the lazy names. Use::

        __getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
    """

    def __getattr__(name: str) -> Any:
        try:
            target = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module_name, attr = (target, name) if isinstance(target, str) else target
        value = getattr(importlib.import_module(module_name), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        listed = namespace.get("__all__")
        names = set(namespace) if listed is None else set(listed)
        return sorted(names | set(table))

    return __getattr__, __dir__
