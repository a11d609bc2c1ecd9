"""docs/*.md against the code: what a newcomer copies from them names things that exist.

Every ``python`` block parses, imports only what exists, imports ``autopipe`` where it uses
it, and calls autopipe's functions and classes with arguments their signatures take (a stale
``profile(model, x, repeats=3)`` fails here), as does every ``autopipe.f(...)`` call in the
running text; every ``autopipe COMMAND ... --flag`` the pages show is a flag of that command;
every dotted ``autopipe.*`` name resolves and every repository path they cite exists. The
blocks are not run here: they profile models (seconds each) and several need torchrun;
tests/test_readme.py runs the README's blocks, whose Python API these pages detail.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from test_readme import Block, readme_blocks

from autopipe.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
PYTHON_BLOCKS = [(page, b) for page in PAGES for b in readme_blocks(page.read_text())
                 if b.language == "python"]  # fmt: skip
COMMAND = re.compile(r"autopipe (plan|profile|explain|emit|devices|plot|bench|run|replay)\b")
REPOSITORY_FOLDERS = ("autopipe", "profiler", "planner", "runtime", "benchmarks", "examples",
                      "tests", "docs")  # fmt: skip


def _resolve(dotted: str) -> Any:
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for part in parts[k:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(dotted)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain rooted at a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _autopipe_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted autopipe name it was imported as."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "autopipe":
                    names[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else "autopipe"
                    )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autopipe"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


@pytest.mark.parametrize(
    "page, block", PYTHON_BLOCKS, ids=[f"{p.stem}-line{b.line}" for p, b in PYTHON_BLOCKS]
)
def test_python_block_imports_exist_and_calls_fit_the_signatures(
    page: Path, block: Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The blocks run from the repository's root, where `examples` imports as a package.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    where = f"{page.name}:{block.line}"
    tree = ast.parse(block.text, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), (where, node.module, alias.name)
    names = _autopipe_names(tree)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "autopipe"}
    assert used <= set(names), f"{where}: uses autopipe without importing it"
    _check_calls(tree, names, where)


def _check_calls(tree: ast.AST, names: dict[str, str], where: str) -> None:
    """Every call of an autopipe function or class in ``tree`` binds to its signature."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        head = (dotted or "").split(".")[0]
        if dotted is None or head not in names:
            continue  # a call on a value the block made, or not autopipe's
        full = names[head] + dotted[len(head) :]
        signature = inspect.signature(_resolve(full))
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        if any(isinstance(a, ast.Starred) for a in node.args) or len(keywords) < len(node.keywords):
            continue  # *args or **kwargs: what is passed is not spelled out
        try:
            signature.bind_partial(*node.args, **keywords)
        except TypeError as e:  # an argument the function does not take
            raise AssertionError(f"{where}: {full}{signature}: {e}") from None


def test_inline_autopipe_calls_fit_the_signatures() -> None:
    """A call shown in running text (`autopipe.replay(..., medians=False)`) binds too."""
    checked = 0
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", prose):
            if not span.startswith("autopipe.") or "(" not in span:
                continue
            try:
                tree = ast.parse(span.replace("\n", " "), mode="eval")
            except SyntaxError:
                continue  # a signature written out (`f(a, *, b)`), not a call
            _check_calls(tree, {"autopipe": "autopipe"}, f"{page.name}: {span}")
            checked += 1
    assert checked > 5


def _command_flags() -> dict[str, set[str]]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: set(parser._option_string_actions) for name, parser in sub.choices.items()}


def test_every_flag_shown_with_an_autopipe_command_is_one_of_its_flags() -> None:
    flags = _command_flags()
    sources = [*PAGES, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "examples").glob("*.py"))]
    checked = 0
    for source in sources:
        text = re.sub(r"\\\n\s*", " ", source.read_text())  # continuation lines joined
        for number, line in enumerate(text.splitlines(), 1):
            for match in COMMAND.finditer(line):
                rest = re.split(r"\bautopipe |torchrun |#|`|\|", line[match.end() :])[0]
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                    assert flag in flags[match.group(1)], (source.name, number, line)
                    checked += 1
    assert checked > 50  # the pages show commands with flags: the pattern still finds them


def test_every_dotted_autopipe_name_and_repository_path_exists() -> None:
    for page in [*PAGES, ROOT / "ARCHITECTURE.md"]:
        text = page.read_text()
        for name in sorted(set(re.findall(r"\bautopipe(?:\.[A-Za-z_]\w*)+", text))):
            try:
                _resolve(name)
            except (ImportError, AttributeError) as e:
                raise AssertionError(f"{page.name}: {name}: {e}") from None
        for span in re.findall(r"`([^`\s]+)`", text):
            path = re.split(r"[:#]", span)[0]
            if path.split("/")[0] in REPOSITORY_FOLDERS and "/" in path and "*" not in path:
                assert (ROOT / path).exists(), (page.name, span)


RUN_IN_ORDER = ("usage.md",)
"""Pages whose Python blocks run, in order, as one program from a copy of the repository's
root (each other page's blocks are fragments: checked above, not run)."""


@pytest.mark.slow  # ~30 s of CPU: it profiles, plans, trains and benches examples/gpt.py
@pytest.mark.parametrize("name", RUN_IN_ORDER)
def test_the_python_blocks_of_a_page_run_in_order(name: str, tmp_path: Path) -> None:
    """Before, docs/usage.md's blocks used ``model``, ``x``, ``y`` and ``optimizer`` that no
    block defined (NameError)."""
    import os
    import subprocess
    import sys

    blocks = [
        b for b in readme_blocks((ROOT / "docs" / name).read_text()) if b.language == "python"
    ]
    assert blocks
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "AUTOPIPE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    script = "\n".join(b.text for b in blocks)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
