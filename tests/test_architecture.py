"""ARCHITECTURE.md against the code: every file and name it points at exists, and every module
of the package has a test file of its own or a named reason it is tested elsewhere (#23:
tests follow the modules, as torchgpipe's do)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS = {
    "autopipe": ROOT / "autopipe",
    "core": ROOT / "autopipe" / "core",
    "cli": ROOT / "autopipe" / "cli",
    "viz": ROOT / "autopipe" / "viz",
    "profiler": ROOT / "profiler",
    "planner": ROOT / "planner",
    "runtime": ROOT / "runtime",
    "distributed": ROOT / "runtime" / "distributed",
}
"""Each layer's folder; a module's test file is ``test_<module>.py`` or
``test_<layer>_<module>.py``."""

TESTED_ELSEWHERE = {
    "autopipe/parallelizing.py": "`autopipe.parallelize` end to end: tests/test_runtime_pipeline.py",
    "autopipe/replay_report.py": "`autopipe.replay` from files and objects: tests/test_replay.py",
    "autopipe/cli/plot.py": "the command against the API: tests/test_plotting.py, tests/test_viz.py",
    "autopipe/cli/run.py": "torchrun launches: tests/test_distributed_cli.py, test_training.py",
    "autopipe/viz/data.py": "its three data sets: tests/test_viz_bubble/balance/scaling.py",
    "autopipe/viz/plan_plots.py": "`plot_all`, every figure of a plan: tests/test_viz.py",
    "planner/mesh_costs.py": "its formulas worked by hand: tests/test_planner_mesh.py",
    "runtime/distributed/tp_check.py": "plan-time refusals: tests/test_plan_time_refusals.py",
    "profiler/context_expert.py": "attention and MoE facts: tests/test_context_expert_profile.py",
    "runtime/parallelize.py": "`build_pipeline` under `parallelize`: tests/test_runtime_pipeline.py",
    "runtime/distributed/pipeline.py": "every schedule on ranks: tests/test_distributed*.py",
    "runtime/distributed/recorder.py": "`autopipe run --trace` read back: tests/test_replay.py",
    "runtime/distributed/tied.py": "needs two ranks: the gpt_tied cases of tests/test_distributed.py",
}
"""Modules a concern-wide test file covers (the concern-wide files stay, #23), with where."""


def _modules() -> dict[str, Path]:
    """Every module of the package with code, by its path from the repository root."""
    found = {}
    for folder in LAYERS.values():
        for path in sorted(folder.glob("*.py")):
            # A package's __init__ holds lazy names, but viz's computes the plot data.
            if not path.name.startswith("__") or path.parent == LAYERS["viz"]:
                found[path.relative_to(ROOT).as_posix()] = path
    return found


def _test_names(relative: str) -> set[str]:
    """The file names that count as ``relative``'s own test file."""
    path = ROOT / relative
    name = path.parent.name if path.name == "__init__.py" else path.stem
    layers = [layer for layer, folder in LAYERS.items() if folder == path.parent]
    return {f"test_{name}.py", *(f"test_{layer}_{name}.py" for layer in layers)}


def test_every_module_has_its_test_file_or_a_reason() -> None:
    tests = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    modules = _modules()
    assert len(modules) > 100  # the package was really read
    missing = [m for m in modules if not _test_names(m) & tests and m not in TESTED_ELSEWHERE]
    assert missing == [], "add tests/test_<module>.py, or say in TESTED_ELSEWHERE where it is"
    stale = [m for m in TESTED_ELSEWHERE if m not in modules or _test_names(m) & tests]
    assert stale == [], "these have their own test file now (or are gone): drop them"


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """Names ``path`` defines at the top and in its classes (``Class.name``)."""
    names: set[str] = set()

    def collect(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    collect(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.Assign):
                names.update(prefix + t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(prefix + node.target.id)

    collect(ast.parse(path.read_text()).body, "")
    return frozenset(names)


_REFERENCE = re.compile(r"`([\w/.-]+\.(?:py|md))(?::([\w.]+))?`")


def _resolve(reference: str) -> list[Path]:
    """The files a reference in ARCHITECTURE.md can mean: a path from the repository root, a
    path inside the package (``core/plan.py``, ``distributed/recorder.py``), or a bare name."""
    direct = ROOT / reference
    if direct.exists():
        return [direct]
    code = [p for folder in LAYERS.values() for p in folder.glob("*.py")]
    return [p for p in code if p.as_posix().endswith("/" + reference)]


def test_architecture_names_only_what_exists() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    references = _REFERENCE.findall(text)
    assert len(references) > 80  # the concept table was really read
    wrong = []
    for reference, name in references:
        if reference.startswith("MODEL.py"):
            continue  # the user's model file in a command line
        files = _resolve(reference)
        if not files:
            wrong.append(f"{reference}: no such file")
        elif name and not any(name in _defined(f) for f in files if f.suffix == ".py"):
            wrong.append(f"{reference}:{name}: not defined there")
    assert wrong == []
