"""Imports inside functions, by rule: an import sits inside a function only when importing it
at the top would load a heavy or optional package (``HEAVY``) that the module's own import
does not load. That covers a third-party package kept out of a light module's start-up
(torch out of the CLI, ``core`` and the planner; matplotlib out of the CLI; pulp, yaml,
transformers on the one path that needs them) and a module of a costlier layer imported on one
path of a light one (the CLI importing the runtime only when it runs). Every other import
belongs at the top of its module; ``ALLOWED`` lists the few exceptions, each with its reason.

What a module loads is read from the source (its imports outside functions, through the
package's own modules and their parent packages, ``if TYPE_CHECKING:`` left out), and checked
against Python's own ``sys.modules`` in one subprocess."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from package_modules import package_modules

ROOT = Path(__file__).resolve().parents[1]


HEAVY = {
    "torch": "1.6 s to import; the CLI, autopipe.core and the planner run without it",
    "torch.distributed.tensor": "1.1 s on top of torch (DTensor); only mesh runs use it",
    "torch.distributed.fsdp": "0.13 s on top of torch; only sharded mesh runs use it",
    "torch.distributed.optim": "0.24 s on top of torch; only ZeRO-1 runs use it",
    "torch.distributed.checkpoint": "0.55 s on top of torch; only `autopipe run --save` uses it",
    "torch.distributed.pipelining": "2.6 s on top of torch; only zero-bubble splits and ranks use it",
    "matplotlib": "0.3 s to import; only plots use it",
    "transformers": "optional (the dev extra), 1.9 s; only Hugging Face models use it",
    "torchtitan": "optional (the emit extra)",
    "megatron": "optional (the emit extra)",
    "deepspeed": "optional (the emit extra)",
    "pulp": "the ILP cross-check only (33 ms), not the exact DP every plan runs",
    "yaml": "device spec files only (30 ms), not the catalog every command reads",
    "tqdm": "progress bars only (54 ms), not the CLI's start-up for a command that draws none",
}
"""Packages (and torch's subpackages that ``import torch`` does not load) whose import a
light module may defer to the function that needs them, and why."""

IMPLIED = {
    "torch": {"tqdm"},
    "torch.distributed.pipelining": {"torch.distributed.tensor", "torch.distributed.fsdp"},
}
"""What importing a ``HEAVY`` package loads of the others (torch 2.13; the measuring test
below finds any the source cannot see)."""

BESIDE_TORCH = {"pulp", "yaml", "tqdm"}
"""``HEAVY`` packages worth deferring only from a module that does not load torch: next to
torch's 1.6 s they cost nothing worth a lazy import."""

ALLOWED: dict[tuple[str, str], str] = {}
"""(module, imported module) -> why the import sits inside a function though the rule above
would move it to the top."""


@dataclass(frozen=True)
class Import:
    """One import statement: where it is, what it imports, whether it runs inside a function."""

    module: str
    line: int
    targets: tuple[str, ...]
    nested: bool
    text: str


def _lazy_table(path: Path) -> dict[str, str]:
    """A package's lazily imported names (``_LAZY``) -> the module each is imported from."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["_LAZY"]:
            table = ast.literal_eval(node.value)
            return {k: v if isinstance(v, str) else v[0] for k, v in table.items()}
    return {}


@functools.cache
def _imports(module: str) -> tuple[Import, ...]:
    """The import statements of ``module`` that run (``if TYPE_CHECKING:`` left out), each
    with the modules it loads: ``from pkg import name`` loads ``pkg.name`` where that is a
    module, or the module a lazy package attribute comes from."""
    modules = package_modules()
    path = modules[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[Import] = []

    def targets(node: ast.Import | ast.ImportFrom) -> tuple[str, ...]:
        if isinstance(node, ast.Import):
            return tuple(a.name for a in node.names)
        base = node.module or ""
        if node.level:
            stem = package[: len(package) - node.level + 1]
            base = ".".join([*stem, *([node.module] if node.module else [])])
        out = [base]
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules or not base.startswith("autopipe"):
                out.append(sub)  # a module, or (third party) perhaps one
            elif base in modules and modules[base].name == "__init__.py":
                lazy = _lazy_table(modules[base]).get(alias.name)
                if lazy:
                    out.append(lazy)
        return tuple(dict.fromkeys(out))

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse, nested)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                text = ast.unparse(child)
                found.append(Import(module, child.lineno, targets(child), nested, text))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, nested or inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return tuple(found)


def _heavy(name: str) -> str | None:
    """The ``HEAVY`` package that importing ``name`` loads at most (the longest one that is
    ``name`` or contains it), or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in HEAVY:
            return ".".join(parts[:n])
    return None


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: importing a module runs its packages first."""
    parts = name.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


@functools.cache
def _loads(module: str) -> frozenset[str]:
    """The ``HEAVY`` packages that importing ``module`` loads, read from the source."""
    return _heavy_of((module,))


def _heavy_of(names: tuple[str, ...]) -> frozenset[str]:
    """The ``HEAVY`` packages that importing each of ``names`` loads: through the package's
    modules it imports outside functions (and their packages), the third-party ones."""
    modules = package_modules()
    out: set[str] = set()
    todo = [part for name in names for part in _with_parents(name)]
    done: set[str] = set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        if name in modules:
            for imp in _imports(name):
                if not imp.nested:
                    todo.extend(part for t in imp.targets for part in _with_parents(t))
        elif _heavy(name):
            out.update(p for p in _with_parents(str(_heavy(name))) if p in HEAVY)
    for heavy in list(out):
        out |= IMPLIED.get(heavy, set())
    return frozenset(out)


def _nested() -> list[tuple[Import, frozenset[str]]]:
    """Every import inside a function, with the ``HEAVY`` packages it adds to what its
    module's import already loads (empty: it has no reason to sit there)."""
    found = []
    for name in sorted(package_modules()):
        loaded = _loads(name)
        for imp in _imports(name):
            if imp.nested:
                adds = _heavy_of(imp.targets) - loaded
                found.append((imp, adds - BESIDE_TORCH if "torch" in loaded else adds))
    return found


def test_imports_inside_functions_keep_heavy_packages_out() -> None:
    """An import inside a function keeps a ``HEAVY`` package out of its module's start-up
    (directly, or through a module of a costlier layer), or is in ``ALLOWED`` with a reason."""
    assert len(_nested()) > 20  # the imports inside functions were really read
    bad = [
        f"{imp.module}:{imp.line} {imp.text}"
        for imp, adds in _nested()
        if not adds and not any((imp.module, t) in ALLOWED for t in imp.targets)
    ]
    assert bad == [], "move these imports to the top of their module"


def test_exceptions_are_still_needed() -> None:
    """Every ``ALLOWED`` entry still excuses an import the rule rejects."""
    rejected = [imp for imp, adds in _nested() if not adds]
    needed = {(imp.module, t) for imp in rejected for t in imp.targets}
    assert [entry for entry in ALLOWED if entry not in needed] == []


_MEASURE = """
import importlib, json, sys
heavy = json.loads(sys.argv[1])
seen = {}
for name in json.loads(sys.argv[2]):
    before = {h for h in heavy if h in sys.modules}
    importlib.import_module(name)
    seen[name] = sorted(h for h in heavy if h in sys.modules and h not in before)
print(json.dumps(seen))
"""


def _measured(names: list[str]) -> dict[str, list[str]]:
    """Module -> the ``HEAVY`` packages that importing it loaded, importing ``names`` in order
    in one fresh interpreter (each counts only what the ones before had not loaded)."""
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(sorted(HEAVY)), json.dumps(names)],
        capture_output=True, text=True, cwd="/", timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return dict(json.loads(run.stdout))


def _unexpected(seen: dict[str, list[str]]) -> dict[str, list[str]]:
    return {m: sorted(set(h) - _loads(m)) for m, h in seen.items() if set(h) - _loads(m)}


def _importable() -> list[str]:
    """Every module, lightest first (``__main__`` left out: importing it runs the CLI)."""
    runs = [m for m in package_modules() if not m.endswith("__main__")]
    return sorted(runs, key=lambda m: (len(_loads(m)), m))


def test_light_modules_load_what_the_source_says() -> None:
    """The modules the source finds free of torch (the CLI, core, the planner, the plots, the
    application) load, in Python, only the ``HEAVY`` packages the source says: the rule above
    rests on that account."""
    light = [m for m in _importable() if "torch" not in _loads(m)]
    assert "autopipe.planner" in light and "autopipe.cli" in light  # the source was read
    assert _unexpected(_measured(light)) == {}


@pytest.mark.slow
def test_every_module_loads_what_the_source_says() -> None:
    """As above for every module, torch's included (lightest first, so that each one's
    account is checked for the packages the ones before had not loaded). Several seconds:
    it imports torch and its distributed packages."""
    names = _importable()
    assert "torch" in _loads("autopipe.runtime.pipeline")  # the source was really read
    assert _unexpected(_measured(names)) == {}


def test_front_doors_load_no_torch_or_matplotlib() -> None:
    """``import autopipe`` (and its CLI, ``core`` and the planner) stays free of torch and
    matplotlib, so that deferring them inside functions keeps meaning something."""
    code = (
        "import sys, autopipe, autopipe.cli, autopipe.core, autopipe.planner;"
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["[]"]
