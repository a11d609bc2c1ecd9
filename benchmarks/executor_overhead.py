"""Executor overhead and activation memory of autopipe's GPipe on CPU.

    .venv/bin/python benchmarks/executor_overhead.py [--runs 5] [--iters 15] [--threads 1]

1. Time: median seconds per training iteration (forward + backward over one mini-batch) of
   - plain gradient accumulation: the unsplit model, micro-batch by micro-batch;
   - autopipe.GPipe with devices ["cpu"] x K, checkpoint="never" (same model, balance, chunks);
   - the same with devices alternating "cpu"/"cpu:0", which runs stages on worker threads;
   - torchgpipe.GPipe with the same arguments, if torchgpipe is installed
     (``pip install --no-deps torchgpipe``; optional, never a dependency).
   All devices are the same CPU, so no stage overlap is possible: the difference to
   gradient accumulation is the executor's scheduling overhead. Runs are interleaved
   (A B C, A B C, ...) so drift on a shared machine hits all of them alike. The whole
   measurement is repeated ``--runs`` times; the summary gives each runner's paired ratio
   to gradient accumulation, median (min..max) over the runs.
2. Memory: with checkpoint="always", the bytes a stage keeps for backward at its peak: the
   inputs of all M micro-batches (stashed until their backward) plus one micro-batch's
   activations saved during its recomputation, measured on the running pipeline, against
   the planner's ``StagePlan.activation_bytes`` for the same plan.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from spread import MACHINE, add_runs_argument, spread

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
import mlp  # noqa: E402
from autopipe.runtime import GPipe  # noqa: E402
from autopipe.runtime.checkpoint import is_recomputing  # noqa: E402

from autopipe.parallelizing import parallelize  # noqa: E402


def median_s(fn: Callable[[], None], iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timing(iters: int, batch: int, chunks: int, balance: list[int]) -> dict[str, float]:
    """Print one measurement's table; returns each runner's median paired ratio to gradient
    accumulation."""
    model = mlp.build_model()
    x = torch.randn(batch, 512)
    k = len(balance)

    plain = copy.deepcopy(model)

    def accumulate() -> None:
        plain.zero_grad(set_to_none=True)
        for piece in torch.tensor_split(x, chunks):
            (plain(piece).square().sum() / batch).backward()

    ours = GPipe(
        copy.deepcopy(model),
        balance=balance,
        devices=["cpu"] * k,
        chunks=chunks,
        checkpoint="never",
    )

    def autopipe_step() -> None:
        ours.zero_grad(set_to_none=True)
        (ours(x).square().sum() / batch).backward()

    # "cpu" and "cpu:0" are distinct device keys: this layout runs its stages on two worker
    # threads (the multi-device code path) while computing on the same CPU.
    threaded = GPipe(
        copy.deepcopy(model),
        balance=balance,
        devices=["cpu", "cpu:0"] * (k // 2) + ["cpu"] * (k % 2),
        chunks=chunks,
        checkpoint="never",
    )

    def threaded_step() -> None:
        threaded.zero_grad(set_to_none=True)
        (threaded(x).square().sum() / batch).backward()

    runners: dict[str, Callable[[], None]] = {
        "gradient accumulation": accumulate,
        "autopipe.GPipe": autopipe_step,
        "autopipe.GPipe threads": threaded_step,
    }
    try:
        import torchgpipe

        theirs = torchgpipe.GPipe(
            copy.deepcopy(model),
            balance=balance,
            devices=["cpu"] * k,
            chunks=chunks,
            checkpoint="never",
        )

        def torchgpipe_step() -> None:
            theirs.zero_grad(set_to_none=True)
            (theirs(x).square().sum() / batch).backward()

        runners["torchgpipe.GPipe"] = torchgpipe_step
    except ImportError:
        print("torchgpipe not installed (pip install --no-deps torchgpipe): skipped")

    for fn in runners.values():  # warm-up
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(iters):
        for name, fn in runners.items():
            samples[name].append(median_s(fn, 1))
    base = statistics.median(samples["gradient accumulation"])
    print(
        f"\n== Iteration time: examples/mlp.py, batch {batch}, K={k} x cpu, balance {balance}, chunks {chunks}, checkpoint=never =="
    )
    print(f"{'runner':<24}{'median ms':>12}{'ratio of medians':>18}{'median paired ratio':>21}")
    ratios: dict[str, float] = {}
    for name, values in samples.items():
        med = statistics.median(values)
        # Each round runs every runner back to back: the per-round ratio cancels slow drift
        # of a shared machine.
        paired = statistics.median(
            v / b for v, b in zip(values, samples["gradient accumulation"], strict=True)
        )
        print(f"{name:<24}{med * 1e3:>12.2f}{med / base:>17.3f}x{paired:>20.3f}x")
        ratios[name] = paired
    return ratios


def _storage_bytes(tensors: list[Any], exclude: set[int]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in exclude:
                seen[key] = storage.nbytes()
    return sum(seen.values())


def memory(batch: int, chunks: int, k: int) -> None:
    from autopipe.planner import plan as make_plan

    from autopipe.core.request import PlanRequest

    cfg = {"vocab_size": 2048, "seq_len": 64, "d_model": 128, "n_layer": 8, "n_head": 4}
    model = gpt.build_model(**cfg)
    idx = gpt.example_inputs(batch, gpt.GPTConfig(**cfg))
    try:
        from autopipe.profiler.measure import profile as measure

        prof = measure(model, idx)
        source = "measured"
    except (ImportError, AttributeError):
        from autopipe.profiler.analytic import profile_analytic
        from autopipe.profiler.options import AnalyticOptions

        prof = profile_analytic(model, idx, "cpu", AnalyticOptions(dtype="float32"))
        source = "analytic"
    plan = make_plan(
        prof, PlanRequest(gpus=k, batch_size=batch, microbatches=chunks, checkpoint="always")
    )
    # Re-materialized whole (per stage), as measured below; the planner may have picked per
    # unit (benchmarks/rematerialization.py compares the two): its per-stage figure is
    # every micro-batch's stage input plus one micro-batch's activations.
    ratio = (batch / chunks) / prof.batch_size
    cuts = [float(prof.input_bytes), *map(float, prof.cut_bytes)]
    planned_bytes, start = [], 0
    for s in plan.stages:
        acts = sum(u.activation_bytes for u in prof.units[start : start + len(s.units)])
        planned_bytes.append((acts + cuts[start] * chunks) * ratio)
        start += len(s.units)
        s.checkpoint_granularity = "stage"
    pipe = parallelize(model, idx, ["cpu"] * k, plan=plan)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    # Record each forward task's inputs (what the stage keeps until its backward).
    stashed: dict[int, list[list[Any]]] = {j: [] for j in range(k)}
    for j, stage in enumerate(pipe._stages):
        inner = stage.fn

        def recording(*values: Any, _inner=inner, _j=j) -> tuple[Any, ...]:
            if not is_recomputing():
                stashed[_j].append(list(values))
            return _inner(*values)

        stage.fn = recording
    pipe(idx).sum().backward()

    # One micro-batch's saved activations, as its recomputation saves them.
    print(
        f"\n== Saved activations with checkpoint='always': GPT d=128 x 8 blocks, batch {batch}, M={chunks}, K={k} ({source} profile) =="
    )
    print(
        f"{'stage':<7}{'stash MiB':>11}{'recompute MiB':>15}{'measured MiB':>14}{'planned MiB':>13}{'ratio':>8}"
    )
    for j, stage in enumerate(pipe._stages):
        leaves = [
            v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
            for v in stashed[j][0]
        ]
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage.fn(*leaves)
        act_one = _storage_bytes(saved, params | {id(None)})
        stash = sum(_storage_bytes(values, params) for values in stashed[j])
        measured = stash + act_one
        planned = planned_bytes[j]
        print(
            f"{j:<7}{stash / 2**20:>11.2f}{act_one / 2**20:>15.2f}{measured / 2**20:>14.2f}"
            f"{planned / 2**20:>13.2f}{measured / planned:>8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--chunks", type=int, default=8)
    add_runs_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ratios: dict[int, list[dict[str, float]]] = {batch: [] for batch in args.batch}
    for _ in range(args.runs):
        for batch in args.batch:
            ratios[batch].append(timing(args.iters, batch, args.chunks, balance=[4, 3, 3, 3]))
    print(
        f"\n== Over {args.runs} runs ({MACHINE}): median paired ratio to gradient "
        "accumulation, median (min..max) =="
    )
    for batch, runs in ratios.items():
        for name in runs[0]:
            if name != "gradient accumulation":
                print(f"batch {batch:<5} {name:<24} {spread([r[name] for r in runs], unit='x')}")
    memory(batch=16, chunks=4, k=4)


if __name__ == "__main__":
    main()
