"""The package installs one namespace, and the planner stays torch-free."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import autopipe

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "torch-autopipe"
"""The name on the package index ("autopipe" there is another project); the import name and
the command are ``autopipe``."""


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
    (wheel,) = tmp_path.glob(f"{DISTRIBUTION.replace('-', '_')}-{autopipe.__version__}-*.whl")
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


def test_one_version_printed_by_the_cli_and_recorded_in_the_changelog() -> None:
    version = autopipe.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    # The installed distribution takes its version from the package (pyproject.toml's
    # dynamic version), so there is no second copy to drift.
    assert importlib.metadata.version(DISTRIBUTION) == version
    script = Path(sys.executable).parent / "autopipe"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"autopipe {version}"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (\d+\.\d+\.\d+)", changelog, flags=re.M)
    assert headings and headings[0] == version, headings
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == DISTRIBUTION
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
