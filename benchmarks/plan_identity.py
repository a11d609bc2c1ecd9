"""Plans, emitted configs and reports byte for byte: capture them once, compare after a change.

    .venv/bin/python benchmarks/plan_identity.py --capture /tmp/gold    # on the tree before
    .venv/bin/python benchmarks/plan_identity.py --compare /tmp/gold    # on the tree after

The example models (``examples/*.py``) are counted analytically for a catalog device
(``autopipe profile MODEL --device h100``, deterministic) once, into ``DIR/profiles``;
``--compare`` plans from those same saved profiles, so only the planner, the report and the
emitters are compared. Every case runs ``autopipe plan PROFILE FLAGS --json plan.json`` over
schedules, ``--gpus`` 2/4/8, checkpoint modes, strategies and the mesh flags
(``--data-parallel``, ``--tensor-parallel``, ``--shard``, nodes), then, for a plan that was
written, ``autopipe emit`` in every format and ``autopipe explain``. Each command's stdout,
stderr, exit code and written file is one output; the last line says ``N outputs identical``,
how many plan files hold the same fields and values in another schema layout (a version-1
file captured before the Plan / PlanReport split of #37 against its version-2 successor:
the report's keys merged back into the top level) and ``M differ`` (exit 1 when any
differs), naming each one that differs.

The commands run in this process (``autopipe.cli.main``), each in its own working folder
named after the case, so the paths written into outputs are the same on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import io
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

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


def cases() -> list[tuple[str, str, tuple[str, ...]]]:
    """(case name, model, flags) for every model and flag set."""
    out = []
    for model in MODELS:
        for flags in PIPELINE_FLAGS + MESH_FLAGS:
            name = model + "_" + "_".join(f.lstrip("-") for f in flags)
            out.append((name, model, flags))
    return out


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


def _profiles(runner: _Capture, folder: Path) -> None:
    """Count every example model for the catalog device into ``folder`` (once)."""
    folder.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        target = folder / f"{model}.json"
        if target.exists():
            continue
        rc, _, err = runner.run(
            ["profile", str(ROOT / "examples" / f"{model}.py"), "--device", DEVICE, "-o",
             str(target), "-q"]
        )  # fmt: skip
        if rc:
            raise SystemExit(f"profiling {model} failed ({rc}): {err.strip()}")


def _write(path: Path, rc: int, out: str, err: str) -> None:
    path.with_suffix(".stdout").write_text(out)
    path.with_suffix(".stderr").write_text(err)
    path.with_suffix(".rc").write_text(f"{rc}\n")


def run_cases(runner: _Capture, profiles: Path, outdir: Path) -> float:
    """Every case's outputs into ``outdir/<case>/``; returns the seconds they took."""
    start = time.perf_counter()
    cwd = os.getcwd()
    for name, model, flags in cases():
        case = outdir / name
        case.mkdir(parents=True, exist_ok=True)
        os.chdir(case)
        try:
            argv = ["plan", str(profiles / f"{model}.json"), *flags, "--json", "plan.json"]
            _write(Path("plan"), *runner.run(argv))
            if not Path("plan.json").exists():
                continue
            for fmt in EMIT_FORMATS:
                _write(Path(f"emit-{fmt}"), *runner.run(["emit", "plan.json", fmt]))
            _write(Path("explain"), *runner.run(["explain", "plan.json"]))
        finally:
            os.chdir(cwd)
    return time.perf_counter() - start


def plan_content(path: Path) -> dict[str, object]:
    """A plan file's content in the version-1 layout (every field at the top level): a
    version-2 file's ``"report"`` object merged into the top level, so a plan written before
    the Plan / PlanReport split (#37) and after compare field by field, values exact."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and data.get("version") == 2 and isinstance(data.get("report"), dict):
        data = {**{k: v for k, v in data.items() if k != "report"}, **data["report"]}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--capture", type=Path, metavar="DIR", help="write the golden outputs")
    mode.add_argument("--compare", type=Path, metavar="DIR", help="compare with golden outputs")
    args = ap.parse_args()
    runner = _Capture()
    if args.capture is not None:
        gold = args.capture.resolve()
        _profiles(runner, gold / "profiles")
        took = run_cases(runner, gold / "profiles", gold / "cases")
        count = sum(1 for p in (gold / "cases").rglob("*") if p.is_file())
        print(f"captured {count} outputs of {len(cases())} cases in {gold} ({took:.1f} s)")
        return 0
    gold = args.compare.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        new = Path(tmp)
        took = run_cases(runner, gold / "profiles", new / "cases")
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
