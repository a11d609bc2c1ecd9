"""The architecture's import rules, read from the source (imports inside functions included):
``autopipe.core`` imports no torch and nothing else from autopipe; the planner imports no
torch and only ``core`` and itself; every import follows ARCHITECTURE.md's picture of who may
import whom; no import cycles; each public name has one owner."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from package_modules import package_modules

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

    modules = package_modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        graph.add_edges_from((name, t) for t in _runtime_imports(path, name, modules))
    assert len(graph) > 100 and graph.number_of_edges() > 300  # the graph was really read
    cycles = [" -> ".join([*c, c[0]]) for c in nx.simple_cycles(graph, length_bound=8)]
    assert cycles == []


def _picture() -> list[tuple[str, str]]:
    """The arrows of ARCHITECTURE.md's "Who may import whom" diagram (mermaid ``a --> b``)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Who may import whom", 1)[1]
    block = section.split("```mermaid", 1)[1].split("```", 1)[0]
    node = r"(\w+)(?:\[[^\]]*\])?"
    return re.findall(rf"^\s*{node}\s*-->\s*{node}\s*$", block, re.M)


def _layer(module: str) -> str | None:
    """The picture's layer of a module (None: the package root ``autopipe``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    if parts[1] in ("core", "planner", "profiler", "runtime", "viz", "cli"):
        return parts[1]
    return "cli" if parts[1] == "__main__" else "app"


def _layer_edges() -> dict[tuple[str | None, str | None], list[str]]:
    """(importing layer, imported layer) -> the imports between two layers, every one (the
    package root, which imports only ``core.lazy``, is no layer)."""
    modules = package_modules()
    edges: dict[tuple[str | None, str | None], list[str]] = {}
    for name, path in modules.items():
        imported = _runtime_imports(path, name, modules) | {
            n for n in _imports(path) if n.split(".")[0] == "autopipe"
        }  # the second set adds ``if TYPE_CHECKING:`` imports
        for target in imported:
            source_layer, target_layer = _layer(name), _layer(target)
            if None not in (source_layer, target_layer) and source_layer != target_layer:
                edges.setdefault((source_layer, target_layer), []).append(f"{name} -> {target}")
    return edges


def test_imports_follow_the_picture() -> None:
    """Every import between layers follows an arrow, directly or through others."""
    arrows = _picture()
    layers = {a for a, _ in arrows} | {b for _, b in arrows}
    assert layers == {_layer(m) for m in package_modules()} - {
        None
    }  # the picture names every layer
    reach = {a: {a} for a in layers}
    for _ in layers:
        for a, b in arrows:
            for r in reach.values():
                if a in r:
                    r.add(b)
    bad = [i for (a, b), imports in _layer_edges().items() if b not in reach[a] for i in imports]
    assert bad == []


def test_every_arrow_of_the_picture_is_an_import() -> None:
    """The picture shows no dependency the code does not have."""
    edges = _layer_edges()
    assert [arrow for arrow in _picture() if arrow not in edges] == []


def test_layers_point_one_way() -> None:
    """The catalog holds specs only (it does not import the planner); autopipe.device_target and
    the planner stay torch-free."""
    code = (
        "import sys; import autopipe.core.catalog;"
        "assert 'autopipe.planner' not in sys.modules, 'catalog imported the planner';"
        "import autopipe.device_target, autopipe.planner; autopipe.planner.Cluster.from_catalog('a100', 2);"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr


def test_cli_commands_import_only_common() -> None:
    """Each command module imports ``autopipe.cli.common`` and the library, never another
    command or the package that dispatches to them."""
    folder = ROOT / "autopipe" / "cli"
    for path in folder.glob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "autopipe.cli":
                assert [a.name for a in node.names] == ["common"], path.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "autopipe.cli."
            ):
                assert node.module == "autopipe.cli.common", (path.name, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("autopipe.cli"), (path.name, alias.name)


_FRONT_DOORS = {
    "autopipe.planner.emit": {"EmitError", "TORCHTITAN_SCHEDULES", "to_torchtitan",
                              "to_torchtitan_python", "torchtitan_names"},
    "autopipe.replay_report": {"ReplayError"},
    # Left for the session rewriting these files (issue #23); to be owned where they live.
    "autopipe.cli.common": {"Failure", "UsageError"},
    "autopipe.planner.simulate": {"PHASES", "Task"},
}  # fmt: skip
"""Modules that hand on names they import: the emitters' and ``autopipe.replay``'s entries."""


def test_a_modules_all_lists_only_what_it_defines() -> None:
    """Outside a package's ``__init__``, ``__all__`` names only what the module itself
    defines: one owner per name, no second route to it (front doors above aside)."""
    found = {}
    for name, path in package_modules().items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        imported: set[str] = set()
        listed: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                listed = list(ast.literal_eval(node.value))
        handed_on = set(listed) & imported - _FRONT_DOORS.get(name, set())
        if handed_on:
            found[name] = sorted(handed_on)
    assert found == {}


LOOSE_ALLOWED = {
    "autopipe.profiler.profile(example_inputs)": "the user's model inputs, as given",
    "autopipe.profiler.profile_analytic(example_inputs)": "the user's model inputs, as given",
    "autopipe.profiler.trace_units(example_inputs)": "the user's model inputs, as given",
    "autopipe.runtime.build_pipeline(example_inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.forward(*args)": "the user's model inputs, as nn.Module's",
    "autopipe.runtime.Pipeline.forward(**kwargs)": "the user's model inputs, as nn.Module's",
    "autopipe.runtime.Pipeline.loss(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.loss(target)": "the user's labels, as their loss_fn takes them",
    "autopipe.runtime.Pipeline.microbatch_loss(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.microbatch_loss(target)": "the user's labels, as given",
    "autopipe.runtime.Pipeline.run_microbatches(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.step(inputs)": "the user's model inputs, as given",
    "autopipe.runtime.Pipeline.step(target)": "the user's labels, as their loss_fn takes them",
    "autopipe.runtime.GPipe.cuda(*args)": "torch's nn.Module.cuda, forwarded",
    "autopipe.runtime.GPipe.cuda(**kwargs)": "torch's nn.Module.cuda, forwarded",
    "autopipe.runtime.GPipe.cpu(*args)": "torch's nn.Module.cpu, forwarded",
    "autopipe.runtime.GPipe.cpu(**kwargs)": "torch's nn.Module.cpu, forwarded",
    "autopipe.runtime.GPipe.to(*args)": "torch's nn.Module.to, forwarded",
    "autopipe.runtime.GPipe.to(**kwargs)": "torch's nn.Module.to, forwarded",
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


# What the ranks read of a Plan beyond its instructions, each with why (to go with #37's
# Plan / PlanReport split): (file, field).
_REPORT_READS = {
    # the emitted file's header comment says the predicted step, for people
    ("planner/emit_torchtitan.py", "iteration_time_s"),
    # version-1 plans without unit_parameters are checked against the model by bytes
    ("runtime/planned_stages.py", "parameter_size_bytes"),
}


def _plan_reads(path: Path) -> set[str]:
    """Every attribute read off a name ``plan`` (``plan.x``, ``self.plan.x``) in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
            if name == "plan":
                out.add(node.attr)
    return out


def test_the_ranks_read_the_plans_instructions_only() -> None:
    """The runtime, training, the rank agreement and the emitters read a Plan's instruction
    fields (``autopipe.core.plan.INSTRUCTION_FIELDS``), not the planner's report: a
    prediction or a note never changes what a rank does."""
    import dataclasses

    from autopipe.core.plan import INSTRUCTION_FIELDS, Plan
    from autopipe.core.plan_report import PlanReport

    # the Plan is the instructions and its report, nothing else (#37)
    assert {f.name for f in dataclasses.fields(Plan)} == {*INSTRUCTION_FIELDS, "report"}
    report = {f.name for f in dataclasses.fields(PlanReport)} | {"report"}
    assert not report & set(INSTRUCTION_FIELDS)
    found = {
        (str(path.relative_to(ROOT)), name)
        for path in _RANK_READERS
        for name in _plan_reads(path) & report
    }
    assert found == _REPORT_READS


_RANK_READERS = [
    *sorted((ROOT / "runtime").rglob("*.py")),
    ROOT / "autopipe" / "training.py",
    *sorted((ROOT / "planner").glob("emit*.py")),
]
"""The runtime (the rank agreement is ``runtime/distributed/agree.py``), training and the
emitters: what takes a Plan and acts on it."""


_STAGE_REPORT_READS = {
    # version-1 plans without unit_parameters are checked against the model by bytes: the
    # one predicted stage figure a rank reads, for those files only
    ("runtime/planned_stages.py", "parameter_bytes"),
    # a measured step's seconds (TrainResult.steps), not a stage's prediction
    ("autopipe/training.py", "time_s"),
}


def test_the_ranks_read_no_stage_prediction() -> None:
    """The runtime, training, the rank agreement and the emitters read a StagePlan's
    instruction fields, not its predicted figures (``StageReport``'s fields, read through
    the stage as ``stage.forward_s``): any attribute or string of those names in their code
    is found, whatever it is read from, so each one left is listed with why."""
    import dataclasses

    from autopipe.core.plan import STAGE_INSTRUCTION_FIELDS, StagePlan
    from autopipe.core.plan_report import StageReport

    predicted = {f.name for f in dataclasses.fields(StageReport)} | {"time_s"}
    assert {f.name for f in dataclasses.fields(StagePlan)} == {
        *STAGE_INSTRUCTION_FIELDS, "device", "first_module", "last_module", "report"
    }  # fmt: skip
    assert not predicted & {f.name for f in dataclasses.fields(StagePlan)}
    found = set()
    for path in _RANK_READERS:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if isinstance(node, (ast.Attribute, ast.Constant)) and name in predicted:
                found.add((str(path.relative_to(ROOT)), name))
    assert found == _STAGE_REPORT_READS


def test_the_ranks_never_import_or_name_the_report() -> None:
    """No module of the runtime, training or the emitters imports
    ``autopipe.core.plan_report``, names ``PlanReport`` or ``StageReport`` or reads
    ``.report`` (a plan's or a stage's): they are handed a Plan and act on its
    instructions."""
    found = []
    for path in _RANK_READERS:
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), rel)
        found += [f"{rel} imports {n}" for n in _imports(path) if n.endswith("plan_report")]
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in ("PlanReport", "StageReport"):
                found.append(f"{rel} names {node.id}")
            elif isinstance(node, ast.alias) and node.name in ("PlanReport", "StageReport"):
                found.append(f"{rel} imports {node.name}")
            elif isinstance(node, ast.Attribute) and node.attr == "report":
                found.append(f"{rel} reads .report")
    assert len(_RANK_READERS) > 30 and found == []
