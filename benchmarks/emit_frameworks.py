"""Closing table of issue 21: format x model x schedule -> accepted by the framework's own
code ("yes", or the framework's error), on 2 and 4 pipeline ranks.

"Accepted" means the framework built exactly the plan's chunks (the modules torchtitan kept,
the decoder layers Megatron-Core's layout gives each rank and virtual stage) with the plan's
micro-batch count, from the emitted text alone (tests/framework_checks.py says how each
framework's code is reached). Plans come from profiles counted for an A100 (not timed), so
the table is the same on every run. A format autopipe refuses to emit shows its one-line refusal
("refused: ..."); a framework that is not installed shows "not installed".

    python benchmarks/emit_frameworks.py                      # the emit extra (torchtitan 0.2.2)
    python benchmarks/emit_frameworks.py --torchtitan-0.3 DIR # also torchtitan 0.3.0 from DIR

torchtitan 0.3.0 cannot share a process with 0.2.2 (one package name), so its rows run in
a child process with DIR first on PYTHONPATH. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FORMATS = ("torch", "torchtitan", "torchtitan-python", "megatron")
MODELS = ("gpt", "llama")
RANKS = (2, 4)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def _cell(fmt: str, name: str, ranks: int, schedule: str) -> str:
    """One check: "yes", "refused: ...", "not installed" or the framework's error."""
    import framework_checks as fc
    from autopipe.planner.emit import EmitError, emit

    plan = fc.make(name, ranks, schedule, count=True)
    try:
        emit(plan, fmt)
    except EmitError as exc:
        return f"refused: {exc}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if fmt == "torchtitan":
                ok = fc.run_torchtitan_toml(plan, name, Path(tmp)) == fc.expected_stages(
                    plan, "output"
                )
            elif fmt == "torchtitan-python":
                ok = fc.run_torchtitan_python(plan, name, Path(tmp)) == fc.expected_stages(
                    plan, "lm_head"
                )
            elif fmt == "megatron":
                built = fc.run_megatron(plan)
                ok = built == [(c, n, plan.microbatches) for c, n in
                               enumerate(fc.plan_layers(plan))]  # fmt: skip
            else:
                ok = _torch_accepts(plan, name)
    except fc.Unavailable as exc:
        return f"not installed ({exc})"
    except Exception as exc:  # the framework's own refusal is the table's content
        return _first_line(exc)
    return "yes" if ok else "built other stages"


def _torch_accepts(plan: object, name: str) -> bool:
    """torch's pipeline() cuts the model at the split points into the plan's chunks, and
    get_schedule_class resolves the schedule."""
    import framework_checks as fc
    import torch
    from autopipe.planner.emit import to_torch
    from torch.distributed.pipelining import SplitPoint, pipeline
    from torch.distributed.pipelining.schedules import get_schedule_class

    spec = to_torch(plan)  # type: ignore[arg-type]
    get_schedule_class(spec["schedule"].removeprefix("Schedule"))
    model = fc.fresh(name)
    split = {fqn: SplitPoint.BEGINNING for fqn in spec["split_spec"]}
    if name == "gpt":
        from distributed_cases import tiny_gpt

        pipe = pipeline(model, mb_args=(tiny_gpt()[1][:1],), split_spec=split)
    else:
        ids = torch.randint(0, 64, (1, 16))
        pipe = pipeline(model, mb_args=(), mb_kwargs={"input_ids": ids}, split_spec=split)
    if pipe.num_stages != len(plan.stages):  # type: ignore[attr-defined]
        return False
    for i, stage in enumerate(plan.stages):  # type: ignore[attr-defined]
        # Each stage module holds the parameters of exactly the plan's units of that chunk.
        names = [n for n, _ in pipe.get_stage_module(i).named_parameters()]
        expected = [n for u in stage.units for n, _ in _parameters(model, u)]
        if sorted(names) != sorted(expected):
            return False
    return True


def _parameters(model: object, unit: str) -> list[tuple[str, object]]:
    """``unit``'s parameters under their names in the whole model (none for a unit that is
    not a module, e.g. a function node)."""
    try:
        sub = model.get_submodule(unit)  # type: ignore[attr-defined]
    except AttributeError:
        return []
    return [(f"{unit}.{n}", p) for n, p in sub.named_parameters()]


def _schedules(fmt: str) -> tuple[str, ...]:
    import framework_checks as fc

    return fc.MEGATRON_SCHEDULES if fmt == "megatron" else fc.TORCH_SCHEDULES


def rows(formats: tuple[str, ...]) -> list[dict[str, str]]:
    out = []
    for fmt in formats:
        for name in MODELS:
            for schedule in _schedules(fmt):
                cells = {str(k): _cell(fmt, name, k, schedule) for k in RANKS}
                out.append({"format": fmt, "model": name, "schedule": schedule, **cells})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchtitan-0.3", dest="tt03", metavar="DIR",
                        help="a folder holding torchtitan 0.3.0 (pip install --target)")  # fmt: skip
    parser.add_argument("--torchtitan-0.2", dest="tt022", metavar="DIR",
                        help="a folder holding torchtitan 0.2.2 (pip install --target), for the "
                        "TOML rows when 0.3.0 is installed (make install)")  # fmt: skip
    parser.add_argument("--formats", default=",".join(FORMATS), help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = tuple(args.formats.split(","))
    # each torchtitan release from its own folder, first on PYTHONPATH, in a child process
    apart = {"torchtitan-python": args.tt03, "torchtitan": args.tt022}
    here = tuple(f for f in formats if not apart.get(f))
    table = rows(here)
    for fmt, folder in apart.items():
        if fmt not in formats or not folder:
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [folder, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        child = subprocess.run(
            [sys.executable, __file__, "--formats", fmt, "--json"],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        table += json.loads(child.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(table))
        return
    import framework_checks as fc

    titan = f"torchtitan {fc.version('torchtitan')}" + (" and 0.3.0" if args.tt03 else "")
    titan += " and 0.2.2" if args.tt022 else ""
    print(f"torch {fc.version('torch')}, {titan}, megatron-core {fc.version('megatron-core')};"
          " M = 2 x chunks, V = 2 for the multi-stage schedules\n")  # fmt: skip
    print("| format | model | schedule | " + " | ".join(f"{k} ranks" for k in RANKS) + " |")
    print("|---|---|---|" + "---|" * len(RANKS))
    order = {f: i for i, f in enumerate(FORMATS)}
    for row in sorted(table, key=lambda r: order[r["format"]]):
        cells = " | ".join(row[str(k)].replace("|", "\\|") for k in RANKS)
        print(f"| {row['format']} | {row['model']} | {row['schedule']} | {cells} |")


if __name__ == "__main__":
    main()
