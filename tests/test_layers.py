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


_PACKAGES = {"autopipe": "autopipe", "profiler": "autopipe.profiler", "planner": "autopipe.planner",
             "runtime": "autopipe.runtime"}  # fmt: skip
"""Repository folder -> the package it installs as (pyproject's package-dir)."""


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by its import name."""
    found = {}
    for folder, package in _PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _runtime_imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports when it runs, at any depth (imports inside
    functions included; ``if TYPE_CHECKING:`` blocks left out: they never run). ``from pkg
    import sub`` imports the module ``pkg.sub`` where there is one."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    stem = package[: len(package) - child.level + 1]
                    base = ".".join([*stem, *([child.module] if child.module else [])])
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else base
                    if target in modules and target != name:
                        out.add(target)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def test_no_import_cycles() -> None:
    """No module imports, directly or through others, a module that imports it back: not at
    the top, and not inside a function (a lazy import that only hides a cycle)."""
    import networkx as nx

    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, t) for t in _runtime_imports(path, name, modules))
    assert len(graph) > 100 and graph.number_of_edges() > 300  # the graph was really read
    cycles = [" -> ".join([*c, c[0]]) for c in nx.simple_cycles(graph, length_bound=8)]
    assert cycles == []


LOOSE_ALLOWED = {
    "autopipe.profiler.profile(example_inputs)": "the user's model inputs, as given",
    "autopipe.profiler.profile_analytic(example_inputs)": "the user's model inputs, as given",
    "autopipe.profiler.trace_units(example_inputs)": "the user's model inputs, as given",
    "autopipe.runtime.parallelize(example_inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.forward(*args)": "the user's model inputs, as nn.Module's",
    "autopipe.runtime.Pipeline.forward(**kwargs)": "the user's model inputs, as nn.Module's",
    "autopipe.runtime.Pipeline.loss(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.loss(target)": "the user's labels, as their loss_fn takes them",
    "autopipe.runtime.Pipeline.microbatch_loss(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.microbatch_loss(target)": "the user's labels, as given",
    "autopipe.runtime.Pipeline.run_microbatches(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.GPipe.cuda(*args)": "torch's nn.Module.cuda, forwarded",
    "autopipe.runtime.GPipe.cuda(**kwargs)": "torch's nn.Module.cuda, forwarded",
    "autopipe.runtime.GPipe.cpu(*args)": "torch's nn.Module.cpu, forwarded",
    "autopipe.runtime.GPipe.cpu(**kwargs)": "torch's nn.Module.cpu, forwarded",
    "autopipe.runtime.GPipe.to(*args)": "torch's nn.Module.to, forwarded",
    "autopipe.runtime.GPipe.to(**kwargs)": "torch's nn.Module.to, forwarded",
    "autopipe.profiler.profile(**fields)": (
        "MeasureOptions' fields as keywords beside options=MeasureOptions(...); to go when "
        "profiler/measure.py's profile is split into steps"
    ),
}
"""Boundary parameters that may be ``Any`` or ``**kwargs``, and why."""


def _loose_parameters(package: str) -> list[str]:
    """``package``'s public functions (``__all__``, and the public methods of its exported
    classes) with a parameter annotated ``Any`` (alone or in a union) or a ``**kwargs``, as
    ``package.function(parameter)``."""
    import importlib
    import inspect

    module = importlib.import_module(package)
    found = []
    for name in module.__all__:
        obj = getattr(module, name)
        functions = [(name, obj)] if inspect.isfunction(obj) else []
        if inspect.isclass(obj) and obj.__module__.startswith("autopipe"):
            for attr, member in vars(obj).items():
                function = getattr(member, "__func__", member)  # class/static methods
                if (attr == "__init__" or not attr.startswith("_")) and inspect.isfunction(
                    function
                ):
                    functions.append((f"{name}.{attr}", function))
        for qualified, function in functions:
            for p in inspect.signature(function).parameters.values():
                annotation = str(p.annotation) if p.annotation is not p.empty else ""
                star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
                if star == "**" or "Any" in (part.strip() for part in annotation.split("|")):
                    found.append(f"{package}.{qualified}({star}{p.name})")
    return found


@pytest.mark.parametrize("package", ["autopipe.planner", "autopipe.profiler", "autopipe.runtime"])
def test_boundaries_take_typed_values(package: str) -> None:
    """The layers' public functions take the dataclasses (``PlanRequest``, ``Plan``,
    ``Profile``, the options), not ``Any`` or ``**kwargs``, except the user's model inputs and
    torch's own signatures (``LOOSE_ALLOWED``)."""
    loose = _loose_parameters(package)
    assert [p for p in loose if p not in LOOSE_ALLOWED] == []
    stale = [p for p in LOOSE_ALLOWED if p.startswith(package + ".") and p not in loose]
    assert stale == [], "allowed but no longer there: drop them from LOOSE_ALLOWED"
