"""The architecture's import rules, read from the source (imports inside functions included):
``autopipe.core`` imports no torch and nothing else from autopipe; the planner imports no
torch and only ``core`` and itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(folder: str, allowed_autopipe: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).glob("*.py")):
        for name in sorted(_imports(path)):
            top = name.split(".")[0]
            if top == "torch":
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            elif top == "autopipe" and not name.startswith(allowed_autopipe):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize(
    ("folder", "allowed"),
    [
        ("autopipe/core", ("autopipe.core",)),
        ("planner", ("autopipe.core", "autopipe.planner")),
    ],
)
def test_layer_imports(folder: str, allowed: tuple[str, ...]) -> None:
    assert _violations(folder, allowed) == []
