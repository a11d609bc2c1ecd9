"""autopipe's planned split vs torch.distributed.pipelining's even split, side by side.

Same model (examples/gpt.py, default size and batch), same micro-batch count M, same schedule
(GPipe), 2 processes on gloo with one thread each. Every pipeline is built in the same two
processes and their steps alternate, so background load hits all of them alike.

- autopipe: profile on this CPU (1 thread), plan K = 2 (exact DP) at M, run with
  ``autopipe.runtime.distributed.DistributedPipeline``.
- torch: ``torch.distributed.pipelining.pipeline(model, split_spec={"blocks.N": BEGINNING})``
  at equal block counts, ``ScheduleGPipe``. With an odd block count there are two even splits
  (the extra block before or after the cut); both are run.
- control: autopipe's runtime on the first even split, so a gap can be told apart into split
  quality (autopipe vs autopipe-even) and runtime cost (autopipe-even vs torch).
- reference: the whole model in one process (rank 0, one thread), gradient accumulation over
  the same M micro-batches; 2 vCPUs sharing one core bound the pipeline's speed-up.

A step is timed on rank 0 between two barriers (both ranks done). Prints median, min and max
step time of each, the ratios and the load average.
``python benchmarks/distributed.py [--steps N] [--microbatches M|auto] [--batch-size B]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpt  # noqa: E402
from torch_split import torch_split_step  # noqa: E402

N_LAYER = gpt.GPTConfig().n_layer
# Cut points at equal block counts: blocks.N starts stage 1.
EVEN_CUTS = sorted({N_LAYER // 2, (N_LAYER + 1) // 2})


def _even_name(cut: int) -> str:
    return f"torch-{cut}|{N_LAYER - cut}"


def _plan(batch_size: int, microbatches: int | str, plan_path: Path) -> None:
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    from autopipe.core.request import PlanRequest

    torch.set_num_threads(1)
    model = gpt.build_model()
    prof = profile(
        model,
        gpt.example_inputs(batch_size),
        MeasureOptions(threads=1),
        loss_fn=gpt.loss_fn,
        progress=False,
    )
    result = plan(prof, PlanRequest(gpus=2, microbatches=microbatches, schedule="gpipe"))
    result.granularity = "block"
    result.save(plan_path)


def _rank(rank: int, port: int, plan_path: str, steps: int, out: str) -> None:
    from distributed_cases import rank_env

    os.environ.update(rank_env(rank, 2, port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from autopipe.runtime.distributed import DistributedPipeline, init_distributed
    from torch.distributed.pipelining import ScheduleGPipe

    from autopipe.core.plan import load_plan

    init_distributed(timeout_s=600)
    plan = load_plan(plan_path)
    inputs = gpt.example_inputs(plan.batch_size)
    M = plan.microbatches

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def ours_step(pipe: DistributedPipeline) -> Callable[[], None]:
        def step() -> None:
            pipe.module.zero_grad(set_to_none=True)
            pipe.step(inputs)

        return step

    def torch_step(cut: int) -> Callable[[], None]:
        step, _ = torch_split_step(
            rank, gpt.build_model(), inputs, cut, M, ScheduleGPipe, gpt.loss_fn
        )
        return step

    single = gpt.build_model()

    def single_step() -> None:
        if rank == 0:  # rank 1 idles at the barrier
            single.zero_grad(set_to_none=True)
            for chunk in inputs.chunk(M):
                (gpt.loss_fn(single(chunk), chunk) / M).backward()

    units = [u for s in plan.stages for u in s.units]
    cut = units.index(f"blocks.{EVEN_CUTS[0]}")
    even_plan = copy.deepcopy(plan)
    even_plan.stages[0].units, even_plan.stages[1].units = units[:cut], units[cut:]

    runs: dict[str, Callable[[], None]] = {
        "autopipe": ours_step(DistributedPipeline(gpt.build_model(), plan, inputs, gpt.loss_fn)),
        **{_even_name(c): torch_step(c) for c in EVEN_CUTS},
        "autopipe-even": ours_step(
            DistributedPipeline(gpt.build_model(), even_plan, inputs, gpt.loss_fn)
        ),
        "1-process": single_step,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up: shape inference, allocator
        timed(fn)
        timed(fn)
    for _ in range(steps):  # alternate step by step: load changes hit all alike
        for name, fn in runs.items():
            times[name].append(timed(fn))
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-size", type=int, default=16, help="B (default: example_inputs' 16)"
    )
    parser.add_argument("--microbatches", default="4", help="M, or 'auto' (the planner's)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each pipeline")
    parser.add_argument("--plan", help="reuse a saved plan instead of profiling now")
    args = parser.parse_args()

    from distributed_cases import free_port, spawn_ranks

    from autopipe.core.plan import load_plan

    tmp = Path(tempfile.mkdtemp())
    plan_path = Path(args.plan) if args.plan else tmp / "plan.json"
    if not args.plan:
        m = args.microbatches if args.microbatches == "auto" else int(args.microbatches)
        t0 = time.perf_counter()
        _plan(args.batch_size, m, plan_path)
        print(f"profiled and planned in {time.perf_counter() - t0:.1f} s")
    plan = load_plan(plan_path)
    load_before = os.getloadavg()[0]
    spawn_ranks(_rank, 2, (free_port(), str(plan_path), args.steps, str(tmp / "out.json")), 1800)
    load_after = os.getloadavg()[0]
    times = json.loads((tmp / "out.json").read_text())["times"]
    med = {k: statistics.median(v) for k, v in times.items()}

    print(
        f"examples/gpt.py ({N_LAYER} blocks), batch {plan.batch_size}, M = {plan.microbatches}, "
        "GPipe, 2 ranks x 1 thread, gloo"
    )
    blocks = [sum(u.startswith("blocks.") for u in s.units) for s in plan.stages]
    print(
        "  autopipe       planned: "
        + " | ".join(f"{s.units[0]}..{s.units[-1]}" for s in plan.stages)
        + f"  ({blocks[0]}|{blocks[1]} blocks; predicted {plan.iteration_time_s * 1e3:.1f} ms)"
    )
    for c in EVEN_CUTS:
        print(
            f"  {_even_name(c):14s} pipeline(split_spec={{'blocks.{c}': BEGINNING}}): embeddings + "
            f"blocks 0-{c - 1} | blocks {c}-{N_LAYER - 1} + ln_f + head"
        )
    print(
        f"  autopipe-even  autopipe's runtime on the {_even_name(EVEN_CUTS[0])[6:]} split (control)"
    )
    print("  1-process      the whole model in one process, one thread, same M (no pipeline)")
    n = len(times["autopipe"])
    print(f"  {'':14s} {'median step':>12s} {'min':>9s} {'max':>9s}  (n = {n} each, interleaved)")
    for k, v in times.items():
        print(f"  {k:14s} {med[k] * 1e3:9.1f} ms {min(v) * 1e3:6.1f} ms {max(v) * 1e3:6.1f} ms")
    for c in EVEN_CUTS:
        name = _even_name(c)
        print(f"  ratio {name} / autopipe = {med[name] / med['autopipe']:.2f}x")
    first = _even_name(EVEN_CUTS[0])
    print(
        f"  ratio autopipe-even / {first} = {med['autopipe-even'] / med[first]:.2f}x "
        "(runtime cost, same split)"
    )
    print(
        f"  ratio 1-process / autopipe = {med['1-process'] / med['autopipe']:.2f}x (pipeline speed-up)"
    )
    print(
        f"  load average (1 min) before/after: {load_before:.2f} / {load_after:.2f} "
        f"on {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
