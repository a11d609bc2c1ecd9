"""The package's modules as the architecture tests read them (test_layers.py,
test_imports.py, test_architecture.py): which repository folder installs as which package."""

from __future__ import annotations

import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = {"autopipe": "autopipe", "profiler": "autopipe.profiler", "planner": "autopipe.planner",
            "runtime": "autopipe.runtime"}  # fmt: skip
"""Repository folder -> the package it installs as (pyproject's package-dir)."""


@functools.cache
def package_modules() -> dict[str, Path]:
    """Every module of the installed package, by its import name. O(files)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found
