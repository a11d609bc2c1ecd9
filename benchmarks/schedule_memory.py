"""Peak saved activations and step time of each schedule on the one-process executor.

    .venv/bin/python benchmarks/schedule_memory.py [--steps 7] [--ranks 4] [--microbatches 8]
        [--batch 32] [--schedules gpipe,1f1b,...] [--device cpu|cuda]

The example GPT (``examples/gpt.py``, 13 blocks, d_model 256, about 12 M parameters) is cut
into K x V chunks of about equal unit counts and trained with SGD by ``Pipeline.step`` in
each schedule's own per-rank order (the plan's ``actions``). Every step
is measured; the schedules take turns (A B C, A B C, ...) so drift on a shared machine hits
them alike; the first step of each is a warm-up and is not counted.

Per schedule, medians over the steps of:
- peak saved activations (MiB): the most bytes autograd held for backward at once, all ranks
  together (``autopipe.runtime.activations.ActivationMeter``); GPipe holds every micro-batch's
  activations, 1F1B at most K - rank micro-batches' per rank;
- on CUDA also the allocator's peak (``torch.cuda.max_memory_allocated``, MiB), which adds the
  parameters, gradients and temporaries;
- step time (ms, wall clock): forward, backward and the optimizer step.
Each figure is printed beside its ratio to GPipe's. All ranks share one device here (one
process, one CPU or one GPU), so time differences are the executor's order and the
allocator's, not pipeline overlap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
from autopipe.profiler.units import trace_units  # noqa: E402
from autopipe.runtime.activations import ActivationMeter  # noqa: E402
from autopipe.runtime.parallelize import build_pipeline  # noqa: E402
from autopipe.runtime.pipeline import Pipeline  # noqa: E402

from autopipe.core.plan import Plan, StagePlan  # noqa: E402
from autopipe.core.schedule_rules import chunk_ranks  # noqa: E402
from autopipe.core.schedules import virtual_stage_choices  # noqa: E402

MIB = 2**20
ALL = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")


def hand_plan(names: list[str], schedule: str, ranks: int, microbatches: int, batch: int) -> Plan:
    """K x V chunks of about equal unit counts (V: the schedule's smallest above 1, else 1)."""
    choices = virtual_stage_choices(schedule, ranks, len(names))
    virtual = next((v for v in choices if v > 1), choices[0])
    chunks = ranks * virtual
    bounds = [round(c * len(names) / chunks) for c in range(chunks + 1)]
    placed = chunk_ranks(schedule, ranks, virtual)
    stages = [
        StagePlan(index=c, device="", units=names[bounds[c] : bounds[c + 1]], rank=placed[c])
        for c in range(chunks)
    ]
    return Plan(
        ranks, microbatches, batch // microbatches, batch, stages,
        schedule=schedule, virtual_stages=virtual,
    )  # fmt: skip


def one_step(
    pipe: Pipeline, meter: ActivationMeter, opt: torch.optim.Optimizer, idx: torch.Tensor
) -> tuple[float, float, float]:
    """(peak saved MiB, allocator peak MiB or 0, wall ms) of one SGD step."""
    cuda = idx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    meter.reset_peak()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    pipe.step(idx, loss_fn=gpt.loss_fn)
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    allocated = torch.cuda.max_memory_allocated() / MIB if cuda else 0.0
    return meter.peak_bytes / MIB, allocated, wall_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per schedule (first: warm-up)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--schedules", default="gpipe,1f1b", help=f"from {','.join(ALL)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    unknown = sorted(set(schedules) - set(ALL))
    if unknown or args.steps < 2:
        parser.error(f"unknown schedules {unknown}" if unknown else "--steps must be >= 2")
    if args.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device(args.device)
    idx = gpt.example_inputs(args.batch)
    names = trace_units(gpt.build_model(), idx).unit_names
    runs = {}
    for name in schedules:
        plan = hand_plan(names, name, args.ranks, args.microbatches, args.batch)
        pipe = build_pipeline(
            gpt.build_model(), idx, plan, [device] * args.ranks, orders=plan.actions
        )
        pipe.activation_meter = meter = ActivationMeter([*pipe.parameters(), *pipe.buffers()])
        runs[name] = (plan, pipe, meter, torch.optim.SGD(pipe.parameters(), lr=1e-3), [])
    x = idx.to(device)
    for step in range(args.steps):
        for _plan, pipe, meter, opt, rows in runs.values():
            figures = one_step(pipe, meter, opt, x)
            if step > 0:
                rows.append(figures)
    print(
        f"example GPT, batch {args.batch}, M={args.microbatches}, K={args.ranks} ranks on one "
        f"{args.device}, {args.steps - 1} measured steps each (medians)"
    )
    header = f"{'schedule':<18}{'V':>3}{'saved MiB':>11}{'ratio':>7}"
    if device.type == "cuda":
        header += f"{'alloc MiB':>11}{'ratio':>7}"
    print(header + f"{'step ms':>10}{'ratio':>7}")
    base = [statistics.median(col) for col in zip(*runs[schedules[0]][4], strict=True)]
    for name, (plan, *_rest, rows) in runs.items():
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        line = f"{name:<18}{plan.virtual_stages:>3}{med[0]:>11.2f}{med[0] / base[0]:>7.3f}"
        if device.type == "cuda":
            line += f"{med[1]:>11.1f}{med[1] / base[1]:>7.3f}"
        print(line + f"{med[2]:>10.1f}{med[2] / base[2]:>7.3f}")
    print(f"ratios to {schedules[0]}")


if __name__ == "__main__":
    main()
