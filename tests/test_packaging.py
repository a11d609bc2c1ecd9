"""The package installs one namespace, and the planner stays torch-free."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # Run outside the repo so the working directory cannot shadow the installed package.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")


def test_planner_import_does_not_import_torch() -> None:
    out = _run(
        "import sys, autopipe, autopipe.planner, autopipe.core.profile, autopipe.core.plan;"
        "print('torch' in sys.modules)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_layer_folders_are_not_top_level_imports() -> None:
    out = _run(
        "import importlib.util as u;"
        "print([n for n in ('planner', 'profiler', 'runtime') if u.find_spec(n) is not None])"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_wheel_contains_only_the_autopipe_namespace(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 and "No matching distribution" in build.stderr:
        pytest.skip("cannot fetch the build backend here")
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("autopipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"autopipe"}
    # Every package in the source tree ships, under its autopipe name.
    layers = {
        "autopipe": "autopipe",
        "profiler": "autopipe/profiler",
        "planner": "autopipe/planner",
        "runtime": "autopipe/runtime",
    }
    for folder, installed in layers.items():
        # Every module ships, not only the packages: a module left out of
        # package-data or packages fails here rather than on a user's import.
        for module in (ROOT / folder).rglob("*.py"):
            rel = module.relative_to(ROOT / folder).as_posix()
            assert f"{installed}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"
    assert "autopipe/core/plan.py" in names


def test_every_public_name_resolves() -> None:
    import autopipe

    for name in autopipe.__all__:
        assert getattr(autopipe, name) is not None, name
    assert callable(autopipe.profile) and callable(autopipe.plan) and callable(autopipe.parallelize)
