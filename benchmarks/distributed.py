"""autopipe's planned split vs torch.distributed.pipelining's even split, side by side.

Same model (examples/gpt.py, default size), same batch, same micro-batch count M, same
schedule (GPipe), 2 processes on gloo with one thread each. Both pipelines are built in the
same two processes and their steps alternate, so background load hits both alike.

- autopipe: profile on this CPU (1 thread), plan K = 2 (exact DP), run with
  ``autopipe.runtime.distributed.DistributedPipeline``.
- torch: ``torch.distributed.pipelining.pipeline(model, split_spec={"blocks.4": BEGINNING})``,
  the even split at equal layer counts (4 + 4 blocks), ``ScheduleGPipe``.
- control: autopipe's runtime on that even split, so a gap can be told apart into split
  quality (autopipe vs autopipe-even) and runtime cost (autopipe-even vs torch-even).
- reference: the whole model in one process (rank 0, one thread), gradient accumulation over
  the same M micro-batches; on 2 vCPUs that share a core the pipeline speed-up is bounded.

A step is timed on rank 0 between two barriers (both ranks done). Prints the median step time
of each, the ratios and the load average. ``python benchmarks/distributed.py [--steps N] [--microbatches M|auto]``.
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

import gpt  # noqa: E402


def _plan(batch_size: int, microbatches: int | str, plan_path: Path) -> None:
    from autopipe.planner import plan
    from autopipe.profiler.measure import profile

    torch.set_num_threads(1)
    model = gpt.build_model()
    prof = profile(
        model, gpt.example_inputs(batch_size), loss_fn=gpt.loss_fn, progress=False, threads=1
    )
    result = plan(prof, gpus=2, microbatches=microbatches, schedule="gpipe")
    result.meta["granularity"] = "block"
    result.save(plan_path)


def _rank(rank: int, port: int, plan_path: str, steps: int, out: str) -> None:
    from distributed_cases import rank_env

    os.environ.update(rank_env(rank, 2, port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from autopipe.planner.plan import load_plan
    from autopipe.runtime.distributed import DistributedPipeline, init_distributed
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    init_distributed(timeout_s=600)
    plan = load_plan(plan_path)
    inputs = gpt.example_inputs(plan.batch_size)
    M = plan.microbatches

    ours = DistributedPipeline(gpt.build_model(), plan, inputs, gpt.loss_fn)
    # Control: autopipe's runtime on the even split, to separate runtime cost from split quality.
    n_layer = gpt.GPTConfig().n_layer
    units = [u for s in plan.stages for u in s.units]
    cut = units.index(f"blocks.{n_layer // 2}")
    even_plan = copy.deepcopy(plan)
    even_plan.stages[0].units, even_plan.stages[1].units = units[:cut], units[cut:]
    ours_even = DistributedPipeline(gpt.build_model(), even_plan, inputs, gpt.loss_fn)
    theirs_pipe = pipeline(
        gpt.build_model(),
        mb_args=(inputs[: plan.batch_size // M],),
        split_spec={f"blocks.{n_layer // 2}": SplitPoint.BEGINNING},
    )
    theirs_stage = theirs_pipe.build_stage(rank, torch.device("cpu"))
    theirs = ScheduleGPipe(theirs_stage, n_microbatches=M, loss_fn=gpt.loss_fn)
    del theirs_pipe

    def step_ours(pipe: DistributedPipeline) -> None:
        pipe.module.zero_grad(set_to_none=True)
        pipe.step(inputs)

    def step_theirs() -> None:
        theirs_stage.submod.zero_grad(set_to_none=True)
        if rank == 0:
            theirs.step(inputs)
        else:
            theirs.step(target=inputs, losses=[])

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    single = gpt.build_model()
    chunks = inputs.chunk(M)

    def step_single() -> None:
        # Reference: the whole model on rank 0 alone (rank 1 idles), gradient accumulation
        # over the same M micro-batches.
        if rank == 0:
            single.zero_grad(set_to_none=True)
            for chunk in chunks:
                (gpt.loss_fn(single(chunk), chunk) / M).backward()

    runs: dict[str, Callable[[], None]] = {
        "autopipe": lambda: step_ours(ours),
        "torch-even": step_theirs,
        "autopipe-even": lambda: step_ours(ours_even),
        "1-process": step_single,
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
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", default="4", help="M, or 'auto' (the planner's)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each pipeline")
    parser.add_argument("--plan", help="reuse a saved plan instead of profiling now")
    args = parser.parse_args()

    from autopipe.planner.plan import load_plan
    from distributed_cases import free_port, spawn_ranks

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
    result = json.loads((tmp / "out.json").read_text())
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    n_layer = gpt.GPTConfig().n_layer
    print(
        f"examples/gpt.py, batch {plan.batch_size}, M = {plan.microbatches}, GPipe, 2 ranks x 1 thread, gloo"
    )
    print(
        "  autopipe      planned split: "
        + " | ".join(f"{s.units[0]}..{s.units[-1]}" for s in plan.stages)
        + f"  (predicted {plan.iteration_time_s * 1e3:.1f} ms)"
    )
    print(
        f"  torch-even    pipeline(split_spec={{'blocks.{n_layer // 2}': BEGINNING}}): "
        f"embeddings + blocks 0-{n_layer // 2 - 1} | blocks {n_layer // 2}-{n_layer - 1} + ln_f + head"
    )
    print("  autopipe-even autopipe's runtime on torch-even's split (control: runtime cost alone)")
    print("  1-process     the whole model in one process, one thread, same M (no pipeline)")
    print(
        f"  {'':14s} {'median step':>12s} {'min':>9s} {'max':>9s}  (n = {len(result['times']['autopipe'])} each, interleaved)"
    )
    for k, v in result["times"].items():
        print(f"  {k:14s} {med[k] * 1e3:9.1f} ms {min(v) * 1e3:6.1f} ms {max(v) * 1e3:6.1f} ms")
    print(
        f"  ratio torch-even / autopipe      = {med['torch-even'] / med['autopipe']:.2f}x  (planned split speed-up)"
    )
    print(
        f"  ratio 1-process / autopipe       = {med['1-process'] / med['autopipe']:.2f}x  (pipeline speed-up on 2 vCPUs)"
    )
    print(
        f"  ratio autopipe-even / torch-even = {med['autopipe-even'] / med['torch-even']:.2f}x  (runtime overhead, same split)"
    )
    print(f"  load average (1 min) before/after: {load_before:.2f} / {load_after:.2f} on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
