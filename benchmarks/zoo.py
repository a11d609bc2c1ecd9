"""The model zoo from plan to training, as a table: model x step, the figure in each cell.

    python benchmarks/zoo.py [FAMILY ...]

For each family of tests/zoo.py (third-party models from tiny configs, random weights):

- plan: ``autopipe plan --gpus 2 --microbatches 4``, measured and analytic (a100-80gb);
- parallelize: ``autopipe.parallelize(model, inputs, devices=["cpu"] * 4,
  microbatches=4)``, the largest |gradient difference| against the plain model;
- torchrun: the 2-stage plan trained 2 SGD steps (lr 0.1) by ``autopipe run`` under
  torchrun (one launch, tests/zoo_run.py), the largest |loss difference| and the largest
  |weight difference| / lr (the summed gradient difference of the two steps) against one
  process training the plain model.

Prints a Markdown table. Takes about two minutes on 2 CPU cores.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import zoo  # noqa: E402
from autopipe.planner import plan as make_plan  # noqa: E402
from autopipe.profiler.inputs import call_model  # noqa: E402
from autopipe.profiler.objective import default_loss  # noqa: E402
from autopipe.profiler.profile_data import Profile  # noqa: E402

from autopipe import cli  # noqa: E402

LR = 0.1


def plan_cells(family: str, out: Path) -> tuple[str, str]:
    cells = []
    for extra in (
        ["--save-profile", str(out / f"{family}.profile.json")],
        ["--device", "a100-80gb"],
    ):
        code = cli.main(
            ["plan", f"{zoo.__file__}:{family}", "--gpus", "2", "--batch-size", "8"]
            + ["--microbatches", "4", "--json", str(out / "p.json"), "-q", "--no-cache", *extra]
        )
        cells.append("ok" if code == 0 else f"exit {code}")
    return cells[0], cells[1]


def parallelize_cell(family: str) -> str:
    import autopipe

    model, inputs = zoo.build(family)
    reference = copy.deepcopy(model)
    try:
        pipe = autopipe.parallelize(
            model, inputs, devices=["cpu"] * 4, microbatches=4,
            profile_options={"warmup": 0, "repeat": 1, "progress": False},
        )  # fmt: skip
        default_loss(call_model(pipe, inputs), inputs).backward()
    except Exception as exc:  # the table reports it
        return f"fails: {type(exc).__name__}"
    default_loss(call_model(reference, inputs), inputs).backward()
    got = dict(model.named_parameters())
    worst = max(float((got[n].grad - p.grad).abs().max()) for n, p in reference.named_parameters())
    return f"{worst:.1e}"


def torchrun_cells(families: list[str], out: Path) -> dict[str, str]:
    for family in families:
        saved = out / f"{family}.profile.json"
        measured = Profile.load(saved) if saved.exists() else None
        if measured is None:
            continue
        make_plan(measured, gpus=2, microbatches=4, optimizer="sgd").save(
            out / f"{family}.plan.json"
        )
    runnable = [f for f in families if (out / f"{f}.plan.json").exists()]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(ROOT / "tests" / "zoo_run.py"), str(out), *runnable],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )  # fmt: skip
    cells = {}
    for family in families:
        steps = out / f"{family}.json"
        if not steps.exists():
            cells[family] = "did not run"
            continue
        losses, want = zoo.reference_training(family, LR)
        ran = [s["loss"] for s in json.loads(steps.read_text())["steps"]]
        weights = zoo.load_checkpoint(out / f"{family}.ckpt", out)
        dw = max(float((weights[k] - v).abs().max()) for k, v in want.items())
        dl = max(abs(a - b) for a, b in zip(ran, losses, strict=True))
        cells[family] = f"loss {dl:.1e}, grad {dw / LR:.1e}"
    return cells


def main(families: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = {f: [*plan_cells(f, out), parallelize_cell(f)] for f in families}
        for family, cell in torchrun_cells(families, out).items():
            rows[family].append(cell)
    print(
        "| model | plan (measured) | plan (analytic) | parallelize, max grad diff | torchrun 2 steps |"
    )
    print("|---|---|---|---|---|")
    for family, cells in rows.items():
        print(f"| {family} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or list(zoo.FAMILIES))
