"""Would ``--schedule auto`` be a better default than ``gpipe``? (#36: "consider ``auto`` as
the default schedule where it is strictly better".)

    .venv/bin/python benchmarks/auto_default.py [--mesh] [--json PATH]

Plans each example model (examples/*.py, with the README's commands among them) twice with
the CLI, ``autopipe plan ... --json``: once with the default schedule (no ``--schedule``
flag) and once with ``--schedule auto`` (the schedule, V, M and checkpointing chosen
together), both from the same profile (the cache, or the same analytic count), and prints
one Markdown table: each plan's schedule, V, M, predicted step time (``iteration_time_s``,
seconds per training step) and the ratio default / auto (above 1: auto is faster), then how
many cases auto makes strictly faster (by more than 0.5%) and by how much. ``--mesh`` adds
the README's 70B mesh command (minutes on a loaded CPU). The times are predictions of the
planner, not measurements; the planning wall time of each is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AUTOPIPE = [sys.executable, "-m", "autopipe"]

CASES: list[tuple[str, list[str]]] = [
    ("README quick start", ["examples/gpt.py", "--gpus", "2"]),
    ("README", ["examples/gpt.py", "--gpus", "8"]),
    ("README", ["examples/hf_llama.py", "--gpus", "4"]),
    ("README", ["examples/hf_t5.py", "--gpus", "4", "--units", "encoder.block.*,decoder.block.*"]),
    ("README", ["examples/hf_llama.py:llama2_7b", "--gpus", "8", "--device", "h100"]),
    ("README", ["examples/gpt.py:gpt_6b", "--gpus", "8", "--device", "a100-80gb:4,v100-32gb:4",
                "--dtype", "float16"]),
    ("README", ["examples/gpt.py", "--gpus", "4", "--device-spec", "examples/device-spec.yaml"]),
    ("example", ["examples/mlp.py", "--gpus", "4"]),
    ("example", ["examples/resnet.py", "--gpus", "4"]),
    ("example", ["examples/gpt.py:gpt_6b", "--gpus", "8", "--device", "a100-80gb"]),
    ("example", ["examples/hf_llama.py:llama2_70b", "--gpus", "16", "--device", "h100"]),
]  # fmt: skip
"""(where the command comes from, its arguments after ``autopipe plan``)."""

MESH_CASE = (
    "README mesh",
    ["examples/hf_llama.py:llama2_70b", "--gpus", "32", "--device", "h100", "--tensor-parallel",
     "auto", "--data-parallel", "auto", "--shard", "auto"],
)  # fmt: skip
"""The README's 70B mesh command without its ``--schedule 1f1b`` (the default vs auto)."""

STRICT = 1.005
"""Ratios above this count as auto strictly faster (the plans' own 0.5% tie band)."""


def plan_once(args: list[str], out: Path) -> dict[str, object]:
    """One ``autopipe plan ARGS -q --json OUT`` run; its plan's figures, or its error line."""
    start = time.perf_counter()
    done = subprocess.run(
        [*AUTOPIPE, "plan", *args, "-q", "--json", str(out)], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no message)"]
        return {"error": lines[-1], "wall_s": wall_s}
    data = json.loads(out.read_text())
    return {
        "schedule": data["schedule"],
        "virtual_stages": data["virtual_stages"],
        "microbatches": data["microbatches"],
        "step_s": data["report"]["iteration_time_s"],
        "wall_s": wall_s,
    }


def _cell(row: dict[str, object]) -> str:
    if "error" in row:
        return f"refused: {str(row['error'])[:60]}"
    return (
        f"{row['schedule']} V={row['virtual_stages']} M={row['microbatches']}: "
        f"{float(row['step_s']) * 1e3:.4g} ms"  # type: ignore[arg-type]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", action="store_true", help="also the README's 70B mesh")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ns = parser.parse_args()
    cases = CASES + ([MESH_CASE] if ns.mesh else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (where, args) in enumerate(cases):
            default = plan_once(args, Path(tmp) / f"{i}-default.json")
            auto = plan_once([*args, "--schedule", "auto"], Path(tmp) / f"{i}-auto.json")
            ratio = (
                float(default["step_s"]) / float(auto["step_s"])  # type: ignore[arg-type]
                if "step_s" in default and "step_s" in auto
                else None
            )
            rows.append({"where": where, "args": args, "default": default, "auto": auto,
                         "ratio": ratio})  # fmt: skip
            print(f"[{i + 1}/{len(cases)}] {' '.join(args)}: {ratio}", file=sys.stderr)
    print("| command (`autopipe plan ...`) | from | default schedule | `--schedule auto` "
          "| default / auto | planning s (default, auto) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(
            f"| `{' '.join(r['args'])}` | {r['where']} | {_cell(r['default'])} | "
            f"{_cell(r['auto'])} | {ratio} | {r['default']['wall_s']:.0f}, "
            f"{r['auto']['wall_s']:.0f} |"
        )
    priced = [r["ratio"] for r in rows if r["ratio"] is not None]
    faster = [x for x in priced if x > STRICT]
    slower = [x for x in priced if x < 1 / STRICT]
    print()
    print(
        f"auto strictly faster (> {STRICT:g}x) in {len(faster)} of {len(priced)} priced cases"
        + (
            f": median {statistics.median(faster):.2f}x, range {min(faster):.2f}.."
            f"{max(faster):.2f}x"
            if faster
            else ""
        )
        + f"; slower in {len(slower)}; {len(rows) - len(priced)} refused by either"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
