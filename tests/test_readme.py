"""Every command the README shows runs, as written, in a fresh copy of the repository.

Each fenced ``sh`` block runs as one ``bash -euo pipefail`` script (its commands in order, so
a plan made in a block is the plan the block's later commands use), each ``python`` block as
one ``python -c`` program, in its own copy of the repository with an empty profile cache.
The few commands that cannot run inside the test suite (installing packages, the suite
itself) are listed in :data:`NOT_RUN` with the reason; every other line runs. The README's
relative links must name files and headings that exist.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from distributed_cases import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

NOT_RUN = {
    "make install": "installs packages from the network into .venv (the suite runs inside it)",
    "source .venv/bin/activate": "the suite's PATH starts with the environment's bin already",
    "make test": "the test suite itself: CI runs it (.ci/run)",
}
"""README commands the suite does not run, and why."""

BLOCK_TIMEOUT_S = 600.0
"""Per block: a hang fails the test instead of the whole suite."""

IGNORED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".hypothesis", ".mypy_cache", ".ruff_cache",
)  # fmt: skip
"""What a fresh clone does not have."""


@dataclass(frozen=True)
class Block:
    language: str
    text: str
    line: int  # 1-based line of the opening fence
    heading: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"line{self.line}-{self.language}-{slug}"


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of ``text``, with their language and nearest heading."""
    blocks: list[Block] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        fence = re.match(r"^```(\S*)\s*$", line)
        if fence:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(fence.group(1), body, i + 1, heading))
            i = end
        i += 1
    return blocks


def shell_commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines left out."""
    commands: list[str] = []
    pending = ""
    for line in block.text.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        command = re.sub(r"\s+#.*$", "", pending).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


BLOCKS = readme_blocks(README.read_text())
RUN_BLOCKS = [
    b
    for b in BLOCKS
    if b.heading != "Quickstart"  # run, and its training checked, by its own test below
    and (b.language == "python" or set(shell_commands(b)) - set(NOT_RUN))
]


def test_every_block_is_a_command_block() -> None:
    """A block in another language (or none) would escape the runner."""
    assert BLOCKS
    assert {b.language for b in BLOCKS} <= {"sh", "python"}, [
        (b.line, b.language) for b in BLOCKS if b.language not in ("sh", "python")
    ]


def test_the_commands_not_run_are_shown_and_the_ci_runs_make_test() -> None:
    shown = {c for b in BLOCKS if b.language == "sh" for c in shell_commands(b)}
    assert set(NOT_RUN) <= shown, set(NOT_RUN) - shown  # no stale exception
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), ci


@pytest.fixture()
def fresh_copy(tmp_path: Path) -> Path:
    """The repository's files as a clone has them: git's tracked and not-ignored files (a
    plan.json left in the work tree by hand stays out), or, outside git, the tree without
    what a clone lacks."""
    copy = tmp_path / "autopipe"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        shutil.copytree(ROOT, copy, ignore=IGNORED, symlinks=True)
        return copy
    for name in filter(None, listed.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted but not yet staged is still listed
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name, follow_symlinks=False)
    return copy


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profile cache for the README's commands, empty at first (never the user's): as a
    user's, it is warm for the commands after the first that profiles a model."""
    return tmp_path_factory.mktemp("profile-cache")


def _environment(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The commands as a user runs them once the environment is active: `autopipe`, `python`
    # and `torchrun` from it; torchrun's master port (PET_MASTER_PORT is its --master-port)
    # free, so parallel tests do not collide.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["AUTOPIPE_CACHE_DIR"] = str(cache)
    env["PET_MASTER_PORT"] = str(free_port())
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def _run(
    argv: list[str], cwd: Path, env: dict[str, str], line: int
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own session; past :data:`BLOCK_TIMEOUT_S` the whole session (a
    torchrun agent and its workers too) is killed and the test fails as a hang."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(
            f"README line {line}: still running after {BLOCK_TIMEOUT_S:g} s"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_readme_block_runs_as_written(block: Block, fresh_copy: Path, profile_cache: Path) -> None:
    env = _environment(profile_cache)
    if block.language == "python":
        argv = [sys.executable, "-c", block.text]
    else:
        # Lines the suite cannot run are left out; every other line runs as written.
        kept = [
            line
            for line in block.text.splitlines()
            if re.sub(r"\s+#.*$", "", line).strip() not in NOT_RUN
        ]
        argv = ["bash", "-euo", "pipefail", "-c", "\n".join(kept) + "\n"]
    out = _run(argv, fresh_copy, env, block.line)
    report = (
        f"README line {block.line}:\n{block.text}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    )
    assert out.returncode == 0, report
    assert "Traceback" not in out.stderr, report
    assert " error: " not in out.stderr, report


def test_the_quickstart_trains_the_plan_it_made(fresh_copy: Path, profile_cache: Path) -> None:
    """The Quickstart's two commands: a plan for 2 ranks, then those 2 ranks train it."""
    (quick,) = [b for b in BLOCKS if b.heading == "Quickstart"]
    plan_cmd, run_cmd = shell_commands(quick)
    assert "--gpus 2" in plan_cmd and "--nproc-per-node 2" in run_cmd
    argv = ["bash", "-euo", "pipefail", "-c", quick.text]
    out = _run(argv, fresh_copy, _environment(profile_cache), quick.line)
    assert out.returncode == 0, out.stderr
    steps = re.findall(r"step (\d+)/3  loss (\S+)", out.stdout)
    assert [s for s, _ in steps] == ["1", "2", "3"], out.stdout
    losses = [float(loss) for _, loss in steps]
    assert losses[-1] < losses[0], losses  # it trains
    assert "2 stages x 1 replicas on 2 processes" in out.stdout + out.stderr


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_readme_links_name_files_and_headings_that_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert local
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, (link, sorted(map(_slug, headings)))


def figure_rows(text: str) -> list[list[str]]:
    """The cells of the rows of the table under the README's ``## Figures`` heading."""
    section = text.split("\n## Figures\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def test_every_figure_is_a_median_and_range_from_a_command_that_takes_runs() -> None:
    """Issue 24: a figure is the median and range over the runs its benchmark made, never
    the best run; one run or a deterministic (counted) figure says so; and the command
    that measured it is named, and takes ``--runs`` (benchmarks/spread.py)."""
    rows = figure_rows(README.read_text())
    assert len(rows) >= 8
    for what, figure, runs, source in rows:
        commands = re.findall(r"`(python benchmarks/\w+\.py|pytest tests/\w+\.py)[^`]*`", source)
        assert commands, (what, source)
        for command in commands:
            script = ROOT / command.split()[1]
            assert script.exists(), command
            if command.startswith("python "):
                assert "add_runs_argument(" in script.read_text(), command
        if runs.startswith("deterministic"):
            continue
        count = int(runs.split()[0])
        if count > 1:  # median (min..max), as benchmarks/spread.py prints it
            assert re.search(r"\([^)]*\d\.\.[^)]*\d[^)]*\)", figure), (what, figure)
        else:
            assert "1 run" in runs, (what, runs)
