"""Plans, emitted configs and reports byte for byte, before and after a change.

    .venv/bin/python benchmarks/plan_identity.py --base [REF]              # one command
    .venv/bin/python benchmarks/plan_identity.py --base REF --models mlp --quick
    .venv/bin/python benchmarks/plan_identity.py --capture /tmp/gold    # on the tree before
    .venv/bin/python benchmarks/plan_identity.py --compare /tmp/gold    # on the tree after

``--base REF`` (default: ``git merge-base HEAD main``, the commit this branch started from)
checks out REF in a temporary ``git worktree`` and captures every case twice, each in a
process of its own: once with REF's code (``--capture DIR --tree WORKTREE``: its
``autopipe`` and layer folders imported in place of this checkout's), once with this tree's.
Every printed report, emitted config and counted profile must be identical byte for byte.
A plan file is compared as the format allows: REF's file, loaded by this tree's code and
saved again, must equal this tree's file byte for byte (so a change of the plan format, such
as version 3's, shows as ``(format upgraded)`` on the line, and a change of any value as a
difference). One line per comparison, then the summary; exit 0 only when all are identical.

The example models (``examples/*.py``) are counted analytically for a catalog device
(``autopipe profile MODEL --device h100``, deterministic) once per tree, into
``DIR/profiles``; every case runs ``autopipe plan PROFILE FLAGS --json plan.json`` over
schedules, ``--gpus`` 2/4/8, checkpoint modes, strategies and the mesh flags
(``--data-parallel``, ``--tensor-parallel``, ``--shard``, nodes), then, for a plan that was
written, ``autopipe emit`` in every format and ``autopipe explain``; and the README's
commands on catalog devices (``autopipe plan examples/hf_llama.py:llama2_7b --gpus 8
--device h100`` ...: the README's other commands measure on this machine, which is not
repeatable). Each command's stdout, stderr, exit code and written file is one output.
``--compare`` (against a ``--capture`` of an earlier tree) reads plan files across the
version-1 / version-2 layouts by content (the report merged into the top level).

The commands run in the capturing process (``autopipe.cli.main``), each in its own working
folder named after the case, so the paths written into outputs are the same on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent

MODELS = ("gpt", "mlp", "resnet", "hf_llama", "hf_t5")
DEVICE = "h100"
EMIT_FORMATS = ("torch", "torchtitan", "torchtitan-python", "megatron")

PIPELINE_FLAGS: list[tuple[str, ...]] = [
    *(
        ("--gpus", str(k), "--schedule", s)
        for k in (2, 4, 8)
        for s in ("gpipe", "1f1b", "interleaved-1f1b", "zbv", "auto")
    ),
    ("--gpus", "4", "--schedule", "looped-bfs"),
    ("--gpus", "4", "--schedule", "interleaved-zb"),
    ("--gpus", "4", "--schedule", "dualpipev"),
    ("--gpus", "4", "--microbatches", "8"),
    *(("--gpus", "4", "--checkpoint", c) for c in ("never", "always", "except_last")),
    ("--gpus", "4", "--memory", "2GB", "--batch-size", "64"),
    ("--gpus", "4", "--memory", "1GB", "--batch-size", "256", "--schedule", "auto"),
    ("--gpus", "8", "--memory", "1GB", "--batch-size", "256", "--schedule", "zbv"),
    ("--gpus", "4", "--strategy", "uniform"),
    ("--gpus", "4", "--strategy", "parameters"),
    ("--gpus", "4", "--strategy", "greedy-time"),
    ("--gpus", "3", "--optimizer", "sgd"),
]
MESH_FLAGS: list[tuple[str, ...]] = [
    ("--gpus", "4", "--data-parallel", "2"),
    ("--gpus", "8", "--data-parallel", "auto"),
    ("--gpus", "8", "--data-parallel", "4", "--schedule", "1f1b"),
    ("--gpus", "4", "--tensor-parallel", "auto"),
    ("--gpus", "8", "--tensor-parallel", "2", "--schedule", "1f1b"),
    ("--gpus", "8", "--shard", "auto"),
    ("--gpus", "8", "--shard", "parameters", "--data-parallel", "2"),
    ("--gpus", "8", "--shard", "optimizer", "--checkpoint", "always"),
    ("--gpus", "16", "--tensor-parallel", "auto", "--gpus-per-node", "8"),
    ("--gpus", "8", "--shard", "auto", "--memory", "2GB", "--batch-size", "64"),
]


QUICK_FLAGS: list[tuple[str, ...]] = [
    ("--gpus", "4", "--schedule", "1f1b"),
    ("--gpus", "4", "--schedule", "zbv"),
    ("--gpus", "4", "--data-parallel", "2"),
]
"""``--quick``: one pipeline, one zero-bubble (split backward) and one data-parallel case."""

README_COMMANDS: list[tuple[str, tuple[str, ...]]] = [
    ("readme_llama2_7b", ("examples/hf_llama.py:llama2_7b", "--gpus", "8", "--device", "h100")),
    (
        "readme_gpt_6b_mixed",
        ("examples/gpt.py:gpt_6b", "--gpus", "8", "--device", "a100-80gb:4,v100-32gb:4",
         "--dtype", "float16"),
    ),
    (
        "readme_llama2_70b_mesh",
        ("examples/hf_llama.py:llama2_70b", "--gpus", "32", "--device", "h100",
         "--tensor-parallel", "auto", "--data-parallel", "auto", "--shard", "auto",
         "--schedule", "1f1b"),
    ),
]  # fmt: skip
"""README.md's ``autopipe plan`` commands on catalog devices (counted, so repeatable), run
from the tree's root folder as the README shows them; each plan is emitted and explained."""


def cases(
    models: tuple[str, ...] = MODELS, quick: bool = False
) -> list[tuple[str, str, tuple[str, ...]]]:
    """(case name, model, flags) for every model and flag set."""
    out = []
    for model in models:
        for flags in QUICK_FLAGS if quick else PIPELINE_FLAGS + MESH_FLAGS:
            name = model + "_" + "_".join(f.lstrip("-") for f in flags)
            out.append((name, model, flags))
    return out


def use_tree(tree: Path) -> ModuleType:
    """Import ``autopipe`` from ``tree`` (a checkout: ``autopipe/``, ``planner/``,
    ``profiler/``, ``runtime/``) in place of the installed one, laid out as it installs
    (pyproject's package-dir); returns the imported package. Call before anything imports
    autopipe."""
    import importlib.abc
    import importlib.machinery
    import importlib.util

    folders = {
        "autopipe": tree / "autopipe",
        "autopipe.profiler": tree / "profiler",
        "autopipe.planner": tree / "planner",
        "autopipe.runtime": tree / "runtime",
    }

    class TreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(
            self, name: str, path: object = None, target: object = None
        ) -> importlib.machinery.ModuleSpec | None:
            folder = folders.get(name)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                name, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )

    assert "autopipe" not in sys.modules, "use_tree must run before autopipe is imported"
    sys.meta_path.insert(0, TreeFinder())
    import autopipe.planner

    import autopipe

    for module in (autopipe, autopipe.planner):
        assert Path(str(module.__file__)).resolve().is_relative_to(tree.resolve()), module
    return autopipe


class _Capture:
    """Runs ``autopipe.cli.main`` with stdout, stderr and the log lines in strings."""

    def __init__(self) -> None:
        self.log = io.StringIO()
        handler = logging.StreamHandler(self.log)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root = logging.getLogger()
        root.handlers[:] = [handler]  # autopipe's basicConfig then leaves it alone
        root.setLevel(logging.INFO)

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        from autopipe.cli import main

        out, err = io.StringIO(), io.StringIO()
        self.log.seek(0)
        self.log.truncate()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 1
        return rc, out.getvalue(), err.getvalue() + self.log.getvalue()


def _profiles(
    runner: _Capture, folder: Path, models: tuple[str, ...] = MODELS, tree: Path = ROOT
) -> None:
    """Count every example model of ``tree`` for the catalog device into ``folder`` (once)."""
    folder.mkdir(parents=True, exist_ok=True)
    for model in models:
        target = folder / f"{model}.json"
        if target.exists():
            continue
        rc, _, err = runner.run(
            ["profile", str(tree / "examples" / f"{model}.py"), "--device", DEVICE, "-o",
             str(target), "-q"]
        )  # fmt: skip
        if rc:
            raise SystemExit(f"profiling {model} failed ({rc}): {err.strip()}")


def _write(path: Path, rc: int, out: str, err: str) -> None:
    path.with_suffix(".stdout").write_text(out)
    path.with_suffix(".stderr").write_text(err)
    path.with_suffix(".rc").write_text(f"{rc}\n")


def _plan_emit_explain(runner: _Capture, argv: list[str], case: Path, tree: Path | None) -> None:
    """``autopipe plan ARGV --json plan.json`` run in the folder ``case``, then (when it
    wrote the plan) ``emit`` in every format and ``explain``, each output into ``case``.
    Given a ``tree``, its ``examples/`` is linked into ``case`` while the commands run (the
    README's relative model paths), so no output names the tree's folder."""
    case.mkdir(parents=True, exist_ok=True)
    here = os.getcwd()
    os.chdir(case)
    link = Path("examples")
    if tree is not None:
        link.symlink_to(tree / "examples", target_is_directory=True)
    try:
        _write(Path("plan"), *runner.run(["plan", *argv, "--json", "plan.json"]))
        if not Path("plan.json").exists():
            return
        for fmt in EMIT_FORMATS:
            _write(Path(f"emit-{fmt}"), *runner.run(["emit", "plan.json", fmt]))
        _write(Path("explain"), *runner.run(["explain", "plan.json"]))
    finally:
        if tree is not None:
            link.unlink()
        os.chdir(here)


def run_cases(
    runner: _Capture,
    profiles: Path,
    outdir: Path,
    models: tuple[str, ...] = MODELS,
    quick: bool = False,
    tree: Path | None = None,
) -> float:
    """Every case's outputs into ``outdir/<case>/`` (and, given the ``tree`` whose README
    commands to run, theirs); returns the seconds they took."""
    start = time.perf_counter()
    for name, model, flags in cases(models, quick):
        argv = [str(profiles / f"{model}.json"), *flags]
        _plan_emit_explain(runner, argv, outdir / name, None)
    if tree is not None:
        for name, command in README_COMMANDS[:1] if quick else README_COMMANDS:
            _plan_emit_explain(runner, list(command), outdir / name, tree)
    return time.perf_counter() - start


def plan_content(path: Path) -> dict[str, object]:
    """A plan file's content in the version-1 layout (every field at the top level): a
    version-2 or -3 file's ``"report"`` object merged into the top level, version 3's stage
    reports into their stages and its names back to version 1's (``data_parallel`` was
    ``replicas``, ``data_parallel_rows`` was ``data_parallel``), so a plan written before
    the Plan / PlanReport split (#37) and after compare field by field, values exact."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("report"), dict):
        return data
    version = data.get("version")
    report = dict(data["report"])
    if version == 3:
        stages = report.pop("stages", None) or [{} for _ in data["stages"]]
        data = {**data, "stages": [{**s, **r} for s, r in zip(data["stages"], stages, strict=True)]}
        data["replicas"] = data.pop("data_parallel")
        report["data_parallel"] = report.pop("data_parallel_rows")
    if version in (2, 3):
        data = {**{k: v for k, v in data.items() if k != "report"}, **report}
        data["version"] = 1
    return data


def compare(gold: Path, new: Path) -> tuple[list[str], list[str], list[str]]:
    """Files identical, identical in content (a plan file in another schema layout: the
    same fields and values), and differing (missing on either side counts as differing)."""
    names = {p.relative_to(gold) for p in (gold / "cases").rglob("*") if p.is_file()}
    names |= {p.relative_to(new) for p in (new / "cases").rglob("*") if p.is_file()}
    same, same_content, differ = [], [], []
    for rel in sorted(names):
        a, b = gold / rel, new / rel
        if a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False):
            same.append(str(rel))
        elif (
            a.is_file()
            and b.is_file()
            and a.suffix == ".json"
            and (plan_content(a) == plan_content(b))
        ):
            same_content.append(str(rel))
        else:
            differ.append(str(rel))
    return same, same_content, differ


def _upgraded(path: Path, into: Path) -> bytes | None:
    """The plan file at ``path`` loaded by this tree's code and saved again (its bytes);
    None when this tree refuses to load it (a value its checks refuse: then only its
    content can be compared)."""
    from autopipe.core.plan import PlanFormatError, load_plan

    try:
        load_plan(path).save(into)
    except PlanFormatError:
        return None
    return into.read_bytes()


WALL_CLOCK = "identical but for the seconds the analytic count took (counting.seconds)"


def _without_wall_clock(data: bytes) -> object:
    """A profile's or plan's JSON with the one wall-clock figure it records, the seconds the
    analytic profiler took (``Counting.seconds``, also in a plan's embedded profile), set to
    None: what a README command that counts a model writes differently on every run."""
    value = json.loads(data)
    profile = value.get("report", {}).get("profile") if "stages" in value else value
    if isinstance(profile, dict) and isinstance(profile.get("counting"), dict):
        profile["counting"]["seconds"] = None
    return value


def compare_with_base(base: Path, new: Path) -> dict[str, list[str]]:
    """Print one line per output of ``base`` and ``new`` (each a ``--capture`` folder):
    ``identical``; ``identical (format upgraded ...)`` for a plan file whose bytes differ but
    which this tree's code loads and saves to the new file's bytes; :data:`WALL_CLOCK` for a
    profile or plan that differs in that figure only; else ``DIFFERS`` (or ``MISSING``).
    a plan file this tree refuses to load but whose every field and value (:func:`plan_content`)
    is the new file's: ``identical in content``. Returns each kind's outputs: ``identical``,
    ``upgraded``, ``wall_clock``, ``content``, ``differ``."""
    names = sorted(
        {p.relative_to(base) for p in base.rglob("*") if p.is_file()}
        | {p.relative_to(new) for p in new.rglob("*") if p.is_file()}
    )
    kinds: dict[str, list[str]] = {
        "identical": [], "upgraded": [], "wall_clock": [], "content": [], "differ": []
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for rel in names:
            a, b = base / rel, new / rel
            ours = None
            if not (a.is_file() and b.is_file()):
                kind, word = "differ", "MISSING in " + ("base" if b.is_file() else "new")
            elif filecmp.cmp(a, b, shallow=False):
                kind, word = "identical", "identical"
            elif rel.name == "plan.json" and (ours := _upgraded(a, Path(tmp) / "p.json")) == (
                b.read_bytes()
            ):
                kind = "upgraded"
                word = "identical (format upgraded: the base's file loaded and saved by this tree)"
            elif a.suffix == ".json" and _without_wall_clock(
                ours or a.read_bytes()
            ) == _without_wall_clock(b.read_bytes()):
                kind, word = "wall_clock", WALL_CLOCK + (" (format upgraded)" if ours else "")
            elif rel.name == "plan.json" and ours is None and plan_content(a) == plan_content(b):
                kind = "content"
                word = (
                    "identical in content, every field and value (this tree does not load the "
                    "base's file: its loader refuses a value in both)"
                )
            else:
                kind, word = "differ", "DIFFERS"
            kinds[kind].append(str(rel))
            print(f"{word}: {rel}")
    return kinds


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def _capture_with(tree: Path, folder: Path, extra: list[str]) -> None:
    """``--capture folder --tree tree`` in a process of its own (one tree's code)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--capture", str(folder)]
    done = subprocess.run([*command, "--tree", str(tree), *extra], text=True)
    if done.returncode:
        raise SystemExit(f"capturing with {tree} failed ({done.returncode})")


def run_base(ref: str | None, models: tuple[str, ...], quick: bool, keep: Path | None) -> int:
    """``--base``: REF's outputs against this tree's, one line each, then the summary."""
    ref = ref or _git("merge-base", "HEAD", "main")
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    work = Path(keep or tempfile.mkdtemp(prefix="plan_identity_")).resolve()
    tree = work / "base-tree"
    if (work / "base").is_dir() and (work / "new").is_dir():
        print(f"comparing the outputs kept in {work} (delete it to capture again)")
        return _report(ref, commit, models, quick, compare_with_base(work / "base", work / "new"))
    _git("worktree", "add", "--detach", str(tree), commit)
    try:
        extra = ["--models", ",".join(models), *(["--quick"] if quick else [])]
        # REF counts the profiles; both trees plan from them (the same paths in every
        # output), and this tree counts its own to compare.
        _capture_with(tree, work / "base", extra)
        profiles = ["--profiles", str(work / "base" / "profiles")]
        _capture_with(ROOT, work / "new", [*extra, *profiles])
        _profiles(_Capture(), work / "new" / "profiles", models)  # compared with REF's
    finally:
        _git("worktree", "remove", "--force", str(tree))
    code = _report(ref, commit, models, quick, compare_with_base(work / "base", work / "new"))
    if keep is None:
        shutil.rmtree(work)
    return code


def _report(
    ref: str, commit: str, models: tuple[str, ...], quick: bool, kinds: dict[str, list[str]]
) -> int:
    """Print the summary line; 1 when an output differs."""
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    print(
        f"base {ref} ({commit[:12]}) vs this tree ({_git('rev-parse', '--short=12', 'HEAD')}"
        f"{', with uncommitted changes' if dirty else ''}): "
        f"{sum(map(len, kinds.values()))} outputs of {len(cases(models, quick))} cases and "
        f"{len(README_COMMANDS[:1] if quick else README_COMMANDS)} README commands: "
        f"{len(kinds['identical'])} identical byte for byte, {len(kinds['upgraded'])} plan "
        f"files identical byte for byte once the base's file is loaded and saved by this tree "
        f"(the plan file format changed on purpose), {len(kinds['wall_clock'])} "
        f"{WALL_CLOCK.removeprefix('identical ')}, {len(kinds['content'])} plan files "
        f"identical in every field and value that this tree refuses to load, "
        f"{len(kinds['differ'])} differ"
    )
    return 1 if kinds["differ"] else 0


def _no_progress_bars() -> None:
    """Switch tqdm's bars off in this process (a README command that counts a model shows
    one, with its speed, on stderr, which is not repeatable): every bar is made disabled,
    whatever its caller asked (``autopipe`` passes ``disable=not progress``)."""
    import tqdm.std

    init = tqdm.std.tqdm.__init__

    def disabled(self: tqdm.std.tqdm, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    tqdm.std.tqdm.__init__ = disabled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--base", nargs="?", const="", metavar="REF",
        help="compare with REF's code (default: git merge-base HEAD main)",
    )  # fmt: skip
    mode.add_argument("--capture", type=Path, metavar="DIR", help="write the golden outputs")
    mode.add_argument("--compare", type=Path, metavar="DIR", help="compare with golden outputs")
    ap.add_argument("--tree", type=Path, help="--capture with this checkout's code")
    ap.add_argument("--profiles", type=Path, help="--capture: plan from these profiles")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated examples")
    ap.add_argument("--quick", action="store_true", help="three flag sets per model")
    ap.add_argument(
        "--keep", type=Path,
        help="--base: keep the outputs in this folder (compared again, not re-captured, "
        "when it holds them)",
    )  # fmt: skip
    args = ap.parse_args()
    models = tuple(m for m in args.models.split(",") if m)
    _no_progress_bars()
    if args.base is not None:
        return run_base(args.base or None, models, args.quick, args.keep)
    tree = (args.tree or ROOT).resolve()
    if args.tree is not None:
        use_tree(tree)
    runner = _Capture()
    if args.capture is not None:
        gold = args.capture.resolve()
        profiles = gold / "profiles" if args.profiles is None else args.profiles.resolve()
        _profiles(runner, profiles, models, tree)  # those not there yet
        took = run_cases(runner, profiles, gold / "cases", models, args.quick, tree)
        count = sum(1 for p in (gold / "cases").rglob("*") if p.is_file())
        print(f"captured {count} outputs in {gold} with {tree}'s code ({took:.1f} s)")
        return 0
    gold = args.compare.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        new = Path(tmp)
        took = run_cases(runner, gold / "profiles", new / "cases", models, args.quick)
        # the same relative layout as the golden folder, so case paths match
        same, same_content, differ = compare(gold, new)
    for rel in differ:
        print(f"differs: {rel}")
    print(
        f"{len(same)} outputs identical, {len(same_content)} plan files identical in content "
        f"(fields and values; another schema layout) / {len(differ)} differ ({took:.1f} s)"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
