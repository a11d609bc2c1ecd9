"""The model zoo from plan to training, as a table: model x step, the figure in each cell.

    python benchmarks/zoo.py [FAMILY ...]

For each family of tests/zoo.py (third-party models from tiny configs, random weights):

- plan: ``autopipe plan --gpus 2 --microbatches 4``, measured and analytic (a100-80gb),
  its wall time;
- parallelize: the planned 4-stage cut and another one (``zoo.second_cut``), each at M = 4
  on 4 CPU devices: the largest |gradient difference| of one backward against the plain
  model, then 2 SGD steps of ``Pipeline.loss``: the largest difference of any parameter or
  buffer (persistent or not);
- torchrun: the 2-rank plan (the family's schedule, ``zoo.SCHEDULE_OF``) and its other cut,
  trained 2 SGD steps (lr 0.1) by ``autopipe run`` under torchrun (one launch,
  tests/zoo_run.py): the largest |loss difference| and the largest difference of a parameter
  or persistent buffer / lr against one process training the plain model.

Prints a Markdown table. Takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import zoo  # noqa: E402
from autopipe.planner import plan as make_plan  # noqa: E402
from autopipe.profiler.inputs import call_model  # noqa: E402
from autopipe.profiler.measure import profile  # noqa: E402
from autopipe.profiler.objective import default_loss  # noqa: E402
from autopipe.profiler.options import MeasureOptions  # noqa: E402

from autopipe import cli  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

LR = 0.1


def plan_cells(family: str, out: Path) -> list[str]:
    cells = []
    for extra in (
        ["--save-profile", str(out / f"{family}.profile.json")],
        ["--device", "a100-80gb"],
    ):
        t0 = time.perf_counter()
        code = cli.main(
            ["plan", f"{zoo.__file__}:{family}", "--gpus", "2", "--batch-size", "8"]
            + ["--microbatches", "4", "--json", str(out / "p.json"), "-q", "--no-cache", *extra]
        )
        cells.append(f"ok {time.perf_counter() - t0:.1f} s" if code == 0 else f"exit {code}")
    return cells


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(
        (
            float((a[k].detach().float() - v.detach().float()).abs().max())
            for k, v in b.items()
            if v.numel()
        ),
        default=0.0,
    )


def parallelize_cell(family: str) -> str:
    import autopipe

    model, inputs = zoo.build(family)
    measured = profile(model, inputs, MeasureOptions(warmup=0, repeat=1), progress=False)
    planned = make_plan(measured, PlanRequest(gpus=4, microbatches=4, optimizer="sgd"))
    figures = []
    for plan in (planned, zoo.second_cut(measured, planned)):
        model, inputs = zoo.build(family)
        reference = copy.deepcopy(model)
        try:
            pipe = autopipe.parallelize(model, inputs, devices=["cpu"] * 4, plan=plan)
            default_loss(call_model(pipe, inputs), inputs).backward()
        except Exception as exc:  # the table reports it
            return f"fails: {type(exc).__name__}"
        default_loss(call_model(reference, inputs), inputs).backward()
        got = dict(model.named_parameters())
        grad = max(
            float((got[n].grad - p.grad).abs().max()) for n, p in reference.named_parameters()
        )
        zoo.reference_training(family, LR, model=reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(2):
            optimizer.zero_grad()
            pipe.loss(inputs).backward()
            optimizer.step()
        state = _largest(dict(model.named_parameters()), dict(reference.named_parameters()))
        state = max(state, _largest(dict(model.named_buffers()), dict(reference.named_buffers())))
        figures.append(f"{plan.balance}: grad {grad:.0e}, state {state:.0e}")
    return "; ".join(figures)


def torchrun_cells(families: list[str], out: Path) -> dict[str, str]:
    profiles = {
        f: out / f"{f}.profile.json" for f in families if (out / f"{f}.profile.json").exists()
    }
    runnable = list(profiles)
    zoo.write_plans(out, runnable, profiles)
    runs = [f"{f}.{cut}" for f in runnable for cut in zoo.CUTS]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(ROOT / "tests" / "zoo_run.py"), str(out), *runs],
        capture_output=True, text=True, cwd=ROOT, timeout=1800,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )  # fmt: skip
    cells = {}
    for family in families:
        figures = []
        losses, want = zoo.reference_training(family, LR)
        for cut in zoo.CUTS:
            steps = out / f"{family}.{cut}.json"
            if not steps.exists():
                figures.append(f"{cut}: did not run")
                continue
            ran = [s["loss"] for s in json.loads(steps.read_text())["steps"]]
            weights = zoo.load_checkpoint(out / f"{family}.{cut}.ckpt", out)
            dl = max(abs(a - b) for a, b in zip(ran, losses, strict=True))
            figures.append(f"{cut}: loss {dl:.0e}, state {_largest(weights, want) / LR:.0e}")
        cells[family] = "; ".join(figures)
    return cells


def main(families: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = {f: [*plan_cells(f, out), parallelize_cell(f)] for f in families}
        for family, cell in torchrun_cells(families, out).items():
            rows[family].append(cell)
    print(
        "| model | plan (measured) | plan (analytic) | parallelize, 2 cuts, max diff "
        "| torchrun 2 ranks, 2 steps, 2 cuts |"
    )
    print("|---|---|---|---|---|")
    for family, cells in rows.items():
        print(f"| {family} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or list(zoo.FAMILIES))
