"""Every pipeline schedule, predicted vs measured, and autopipe's ``--schedule auto`` plan vs
torch's usual default, side by side on 2 ranks.

Model: examples/gpt.py (13 blocks, LM-head heavy: the head is the most expensive unit), batch
B (default 16). 2 processes on gloo, one thread each. Every pipeline is built in the same two
processes and their steps alternate step by step, so background load hits all alike.

- One profile, measured by rank 0 alone while rank 1 waits (one thread, the thread CPU
  clock), at the batch and at 8, 4, 2 and 1 samples for the per-micro-batch fits (forward,
  backward, and its split into input- and weight-gradient time each get ``a + c b``), with
  ``scale_to_reference=True``: the whole model is timed too and the units are scaled to add
  up to it (units timed alone add up to 15-18% less than the whole model in the
  profile's rounds here; see docs/profiler.md, step 4).
- The link between the ranks: gloo's point-to-point latency and bandwidth, measured by a
  ping-pong between the two processes and given to the planner (its CPU "devices" otherwise
  have free links).
- The host: the two ranks are processes on one machine, so they share its compute. Its
  throughput (``Cluster.host_throughput``, in ranks' worth: 2.0 on two free cores) is ``2 x``
  one forward and backward of the model at one micro-batch alone over its time while both
  ranks run it at once; the planner prices every schedule with it (``--host dedicated``
  plans as if the ranks were dedicated devices, for comparison).
- For each schedule (V = 1 for gpipe and 1f1b, V = 2 for the others) a plan for K = 2 at one
  M (default 8, which every schedule's rules accept at K = 2), forced schedule and V, chunk
  boundaries by the planner; run with ``autopipe.runtime.distributed.DistributedPipeline``.
- auto: ``schedule="auto"`` (schedule, V, chunks and M chosen by the planner).
- torch-default: what a torch user writes by hand: ``pipeline(split_spec=...)`` at an even
  split by block count and ``Schedule1F1B``, M = auto's M (same batch).

A step is timed on rank 0 between two barriers. A rank's busy time is the time spent inside
its stages' ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
(wrapped on the instances); the measured bubble is ``1 - mean_rank(busy) / step``. The
closed forms are the papers' for equal stages (``F``, ``B``, ``W``: one chunk's forward,
input-gradient and weight-gradient seconds per micro-batch, from the profile):

- gpipe, 1f1b: ``(K-1) / (M+K-1)``;
- interleaved-1f1b, looped-bfs: ``(K-1) / (V M + K-1)`` (Narayanan et al. 2021);
- interleaved-zb (ZB-H1 per chunk): idle ``(K-1)(F+B-W)`` over ``V M (F+B+W)`` of work
  (Qi et al. 2024);
- zbv: idle ``(K-1)(F+B-2W)`` (clamped at 0) per chunk (Qi et al. 2024, ZB-V);
- dualpipev: none stated (the DeepSeek-V3 report's ``(K/2-1)(F&B+B-3W)`` is for the
  two-direction DualPipe, not the V variant torch runs).

Replay (``autopipe.planner.replay``): every pipeline of ours is traced
(``autopipe.runtime.distributed.recorder.PipelineTrace``: each chunk action, loss and step, on
both ranks), and each timed step is replayed through the planner's simulator with its own
durations (and with per-chunk medians); the replayed step is compared with the traced one
(``pipe.step``, first rank's start to last rank's end). The whole of the above (profile,
plan, run, replay) is repeated ``--runs`` times (default 5) and the last table gives, per
schedule, the median and range over the runs of the measured step, the replayed step and
its error, and the profile's prediction's error.

``python benchmarks/schedules.py [--runs R] [--steps N] [--batch-size B] [--microbatches M]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpt  # noqa: E402
from spread import add_runs_argument  # noqa: E402
from torch_split import torch_split_step  # noqa: E402

K = 2
N_LAYER = gpt.GPTConfig().n_layer
FORCED = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("looped-bfs", 2),
    ("interleaved-zb", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]
TORCH_DEFAULT = "torch-default"
# Rounds of the profile (every unit, size and the whole model once per round): this VM's
# speed drifts by tens of percent over seconds to minutes (one thread alone, the whole model's
# step varies 670-1080 ms within 40 s), so the rounds are spread over about a minute, as long
# as the runs they predict take.
PROFILE_WARMUP = int(os.environ.get("AUTOPIPE_BENCH_PROFILE_WARMUP", "3"))
PROFILE_REPEAT = int(os.environ.get("AUTOPIPE_BENCH_PROFILE_REPEAT", "15"))


def _profile_rank(rank: int, port: int, batch_size: int, microbatch_size: int, out: str) -> None:
    """Rank 0 profiles the model alone (rank 1 waits), then both measure the link between
    them and how much of the host's compute two busy ranks share."""
    from distributed_cases import rank_env

    os.environ.update(rank_env(rank, 2, port))
    import torch.distributed as dist
    from autopipe.profiler.measure import profile
    from autopipe.profiler.options import MeasureOptions

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if rank == 0:
        prof = profile(
            gpt.build_model(),
            gpt.example_inputs(batch_size),
            MeasureOptions(
                threads=1,
                microbatch_sizes=(8, 4, 2, 1),
                scale_to_reference=True,
                warmup=PROFILE_WARMUP,
                repeat=PROFILE_REPEAT,
            ),
            loss_fn=gpt.loss_fn,
            progress=False,
        )
        prof.save(out)
    dist.barrier()
    measured = {**_measure_link(rank), "host_throughput": _measure_host(rank, microbatch_size)}
    if rank == 0:
        Path(out).with_suffix(".host.json").write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def _measure_host(rank: int, microbatch_size: int, repeats: int = 7) -> float:
    """How many ranks' worth of compute this host runs at once: ``2 x`` rank 0's time for
    one forward and backward of the model at one micro-batch alone, over the slower rank's
    time when both run it at once (medians of ``repeats``). 2.0 on two free cores; about 1.2
    on this machine's two vCPUs."""
    import torch.distributed as dist

    model = gpt.build_model()
    inputs = gpt.example_inputs(microbatch_size)

    def work() -> float:
        t0 = time.perf_counter()
        gpt.loss_fn(model(inputs), inputs).backward()
        return time.perf_counter() - t0

    work()  # warm-up: allocator, first-call costs
    alone, both = [], []
    for _ in range(repeats):
        dist.barrier()
        if rank == 0:
            alone.append(work())
        dist.barrier()
        t = torch.tensor([work()])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        both.append(float(t))
    if rank != 0:
        return 0.0
    return 2.0 * statistics.median(alone) / statistics.median(both)


def _measure_link(rank: int, sizes_bytes: tuple[int, ...] = (4096, 1 << 22)) -> dict[str, float]:
    """gloo's point-to-point cost between the two processes, ``latency_s + bytes /
    bandwidth_bytes_per_s``, fitted to the median one-way time (half a ping-pong) of two
    message sizes. The planner's cluster otherwise has free links between CPU "devices"."""
    import torch.distributed as dist

    one_way = []
    for size in sizes_bytes:
        buf = torch.zeros(size // 4)
        times = []
        for _ in range(21):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        one_way.append(statistics.median(times))
    (small, big), (t_small, t_big) = sizes_bytes, one_way
    bandwidth = (big - small) / max(t_big - t_small, 1e-9)
    return {
        "latency_s": max(t_small - small / bandwidth, 0.0),
        "bandwidth_bytes_per_s": bandwidth,
    }


def _plans(
    prof: Any, m: int, schedules: list[str], link: dict[str, float], tmp: Path
) -> dict[str, str]:
    from autopipe.planner import plan

    from autopipe.core.cluster import Cluster
    from autopipe.core.request import PlanRequest

    cluster = Cluster.homogeneous(
        K,
        name=prof.device,
        link_bandwidth_bytes_per_s=link.get("bandwidth_bytes_per_s", float("inf")),
        link_latency_s=link.get("latency_s", 0.0),
        host_throughput=link.get("host_throughput"),
    )
    paths = {}
    for schedule, v in FORCED:
        if schedule not in schedules:
            continue
        p = plan(
            prof, PlanRequest(cluster=cluster, microbatches=m, schedule=schedule, virtual_stages=v)
        )
        p.granularity = "block"
        paths[schedule] = str(tmp / f"{schedule}.json")
        p.save(paths[schedule])
    p = plan(prof, PlanRequest(cluster=cluster, microbatches="auto", schedule="auto"))
    p.granularity = "block"
    paths["auto"] = str(tmp / "auto.json")
    p.save(paths["auto"])
    return paths


class Busy:
    """Seconds spent inside a PipelineStage's compute methods since the last ``reset``."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: list[Any]) -> None:
        self.seconds = 0.0
        for stage in stages:
            for name in self.METHODS:
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return run

    def reset(self) -> None:
        self.seconds = 0.0


def _torch_default_m(auto: Any) -> int:
    """torch-default's M: auto's, at least K (Schedule1F1B refuses fewer micro-batches)."""
    return max(int(auto.microbatches), K)


def _rank(rank: int, port: int, paths: dict[str, str], steps: int, out: str) -> None:
    from distributed_cases import rank_env

    os.environ.update(rank_env(rank, 2, port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from autopipe.runtime.distributed import DistributedPipeline, init_distributed
    from torch.distributed.pipelining import Schedule1F1B

    from autopipe.core.plan import load_plan

    init_distributed(timeout_s=900)
    plans = {name: load_plan(path) for name, path in paths.items()}
    batch_size = plans["auto"].batch_size
    inputs = gpt.example_inputs(batch_size)

    from autopipe.runtime.distributed.recorder import PipelineTrace

    from autopipe.core.timeline import save_chrome_trace

    runs: dict[str, tuple[Callable[[], None], Busy]] = {}
    traces: dict[str, PipelineTrace] = {}
    for name, p in plans.items():
        pipe = DistributedPipeline(gpt.build_model(), p, inputs, gpt.loss_fn)

        def ours(pipe: DistributedPipeline = pipe) -> None:
            pipe.module.zero_grad(set_to_none=True)
            pipe.step(inputs)

        runs[name] = (ours, Busy(pipe.stages))
        # Every step of every pipeline, for the replay (the Busy wrappers sit inside).
        traces[name] = PipelineTrace(pipe)

    torch_default, stage = torch_split_step(
        rank, gpt.build_model(), inputs, N_LAYER // 2, _torch_default_m(plans["auto"]),
        Schedule1F1B, gpt.loss_fn,
    )  # fmt: skip
    runs[TORCH_DEFAULT] = (torch_default, Busy([stage]))

    def timed(fn: Callable[[], None], busy: Busy) -> tuple[float, float]:
        dist.barrier()
        busy.reset()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, busy.seconds

    for fn, busy in runs.values():  # warm-up: shape inference, allocator
        for _ in range(WARMUP_STEPS):
            timed(fn, busy)
    times: dict[str, list[float]] = {name: [] for name in runs}
    busy_s: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(steps):
        for name, (fn, busy) in runs.items():
            t, b = timed(fn, busy)
            times[name].append(t)
            busy_s[name].append(b)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, busy_s)
    trace_paths = {}
    for name, trace in traces.items():
        timeline = trace.gather()
        if timeline is not None:
            trace_paths[name] = str(Path(out).with_name(f"trace_{name}.json"))
            save_chrome_trace(timeline, trace_paths[name])
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "busy": gathered, "traces": trace_paths}))
    dist.destroy_process_group()


def closed_form(
    schedule: str, k: int, v: int, m: int, f: float, b: float, w: float
) -> float | None:
    """The bubble fraction of a schedule with equal chunks (see the module docstring)."""
    if schedule in ("gpipe", "1f1b"):
        return (k - 1) / (m + k - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return (k - 1) / (v * m + k - 1)
    work = v * m * (f + b + w)
    if schedule == "interleaved-zb":
        idle = (k - 1) * max(f + b - w, 0.0)
    elif schedule == "zbv":
        idle = (k - 1) * max(f + b - 2 * w, 0.0)
    else:
        return None
    return idle / (idle + work)


def _chunk_fbw(p: Any) -> tuple[float, float, float]:
    """Mean per-chunk forward, input-gradient and weight-gradient seconds per micro-batch."""
    n = len(p.stages)
    f = sum(s.forward_s for s in p.stages) / n
    bi = sum(s.backward_input_s for s in p.stages) / n
    bw = sum(s.backward_weight_s for s in p.stages) / n
    if bi + bw == 0.0:
        full = sum(s.backward_s for s in p.stages) / n
        bi = bw = full / 2
    return f, bi, bw


WARMUP_STEPS = 2
"""Untimed steps of each pipeline before the timed ones (shape inference, allocator)."""


def _replayed(trace_path: str, plan: Any) -> dict[str, float]:
    """The traced run's median step (over the timed steps) measured and replayed, with
    each action's durations and with per-chunk medians (autopipe.planner.replay)."""
    from autopipe.planner.replay import replay, split_steps

    from autopipe.core.timeline import load_chrome_trace

    timeline = load_chrome_trace(trace_path)
    own = replay(timeline, plan)[WARMUP_STEPS:]
    steps = split_steps(timeline)[WARMUP_STEPS:]
    med = replay(timeline, plan, medians=True)[WARMUP_STEPS:]
    return {
        "measured_s": statistics.median(s.measured_s for s in own),
        "replayed_s": statistics.median(s.replayed_s for s in own),
        "replayed_medians_s": statistics.median(s.replayed_s for s in med),
        "remainder_s": statistics.median(s.remainder_s for s in own),
        "dispatch_s": statistics.median(sum(s.overheads.dispatch_total_s) for s in own),
        "tail_s": statistics.median(s.overheads.tail_s for s in own),
        "slowdown": _slowdown(steps),
    }


def _slowdown(steps: list[Any]) -> float:
    """How much longer a chunk's action takes while the other rank computes too than while
    it computes alone: per chunk and phase the ratio of the medians of actions that overlap
    the other rank's actions for more than 80% and for less than 20% of their time; the
    median over chunks and phases (1.0: no chunk has both kinds). The two ranks share this
    host's cores, so an action's duration depends on what the other rank does meanwhile."""
    alone: dict[tuple[int, str], list[float]] = {}
    both: dict[tuple[int, str], list[float]] = {}
    for step in steps:
        work = [t for t in step.tasks if t.phase != "recompute"]
        for t in work:
            if t.phase == "loss" or t.duration_s <= 0:
                continue
            overlap = sum(
                max(0.0, min(t.end_s, u.end_s) - max(t.start_s, u.start_s))
                for u in work
                if u.device != t.device
            )
            share = overlap / t.duration_s
            into = alone if share < 0.2 else both if share > 0.8 else None
            if into is not None:
                into.setdefault((t.stage, t.phase), []).append(t.duration_s)
    ratios = [
        statistics.median(both[key]) / statistics.median(alone[key])
        for key in alone.keys() & both.keys()
    ]
    return statistics.median(ratios) if ratios else 1.0


def _replay_saved(folder: Path) -> dict[str, dict[str, Any]]:
    """The replay figures of one earlier run, from the plans and traces in ``folder``."""
    from autopipe.core.plan import load_plan

    saved = json.loads((folder / "out.json").read_text())
    out = {}
    for name, path in saved["traces"].items():
        plan = load_plan(folder / f"{name}.json")
        out[name] = {
            **_replayed(str(folder / Path(path).name), plan),
            "predicted_s": plan.iteration_time_s,
            "label": _label(name, plan),
        }
    out["auto"]["torch_default_ratio"] = _torch_default_ratio(saved["times"])
    return out


def _torch_default_ratio(times: dict[str, list[float]]) -> float:
    """torch's default pipeline's median step over auto's, timed side by side in one run."""
    return statistics.median(times[TORCH_DEFAULT]) / statistics.median(times["auto"])


def _label(name: str, plan: Any) -> str:
    return name if name != "auto" else f"auto ({plan.schedule} V={plan.virtual_stages})"


def _err(value: float, reference: float) -> float:
    return (value - reference) / reference


def _span(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """``median (min .. max)`` of ``values`` times ``scale``."""
    xs = [v * scale for v in values]
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))} .. {fmt.format(max(xs))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_runs_argument(parser)  # each run profiles, plans, runs and replays
    parser.add_argument("--batch-size", type=int, default=16, help="B (default 16)")
    parser.add_argument("--microbatches", type=int, default=8, help="M of the forced plans")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each pipeline")
    parser.add_argument(
        "--schedules",
        default=",".join(s for s, _ in FORCED),
        help="comma-separated schedules to run (default: all seven)",
    )
    parser.add_argument(
        "--host",
        choices=["shared", "dedicated"],
        default="shared",
        help="plan the ranks as sharing this host's measured compute (the default) or as "
        "dedicated devices (what a GPU cluster has)",
    )
    parser.add_argument(
        "--from",
        dest="saved",
        nargs="+",
        metavar="DIR",
        help="no new runs: replay the traces that earlier runs left in these folders (the "
        "'profile, plans and traces in DIR' each run prints) and print the replay table",
    )
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    if args.saved:
        print_replay_table([_replay_saved(Path(d)) for d in args.saved], len(args.saved))
        return
    results = []
    for run in range(args.runs):
        print(f"--- run {run + 1} of {args.runs}")
        results.append(one_run(args, schedules))
    print_replay_table(results, args.runs)


def print_replay_table(results: list[dict[str, dict[str, float]]], runs: int) -> None:
    """Per schedule over the runs: the traced step measured, replayed (each action's
    durations; per-chunk medians) and predicted from the profile, median (range)."""
    print(
        f"\nreplay: {runs} runs; per run the median of its timed steps (trace: pipe.step, "
        "first rank's start to last rank's end); errors (x - measured) / measured"
    )
    print(
        f"{'schedule':22s} {'measured ms':>22s} {'replayed ms':>22s} {'error %':>20s} "
        f"{'medians: error %':>20s} {'predicted: error %':>22s} {'runs <= 5%: own, medians':>24s} "
        f"{'slowdown x':>20s}"
    )
    for name in results[0]:
        rows = [r[name] for r in results]
        # auto may choose another schedule in each run: name every choice once.
        labels = list(dict.fromkeys(str(r.get("label", name)) for r in rows))
        label = (
            labels[0]
            if len(labels) == 1
            else f"{name}: "
            + ", ".join(x.removeprefix(f"{name} (").removesuffix(")") for x in labels)
        )
        measured = [r["measured_s"] for r in rows]
        err = [_err(r["replayed_s"], r["measured_s"]) for r in rows]
        err_med = [_err(r["replayed_medians_s"], r["measured_s"]) for r in rows]
        err_pred = [_err(r["predicted_s"], r["measured_s"]) for r in rows]
        within = sum(abs(e) <= 0.05 for e in err)
        within_med = sum(abs(e) <= 0.05 for e in err_med)
        slow = [r.get("slowdown", 1.0) for r in rows]
        print(
            f"{label:22s} {_span(measured, 1e3):>22s} "
            f"{_span([r['replayed_s'] for r in rows], 1e3):>22s} "
            f"{_span(err, 100, '{:+.1f}'):>20s} {_span(err_med, 100, '{:+.1f}'):>20s} "
            f"{_span(err_pred, 100, '{:+.1f}'):>22s} {within:>3d}/{len(rows)} {within_med:>3d}/{len(rows)} "
            f"{_span(slow, 1, '{:.2f}'):>20s}"
        )
    errors = [_err(r[n]["predicted_s"], r[n]["measured_s"]) for r in results for n in r]
    within = sum(abs(e) <= 0.15 for e in errors)
    print(
        f"predicted from the profile within 15% of measured: {within} of {len(errors)} "
        f"(schedule, run) pairs; error {_span(errors, 100, '{:+.1f}')} %"
    )
    ratios = [
        r["auto"]["torch_default_ratio"] for r in results if "torch_default_ratio" in r["auto"]
    ]
    if ratios:
        print(
            f"{TORCH_DEFAULT} (Schedule1F1B, even split) / auto, measured side by side in each "
            f"run: {_span(ratios, 1, '{:.2f}')}x over {len(ratios)} runs (target >= 1.10x)"
        )


def one_run(args: argparse.Namespace, schedules: list[str]) -> dict[str, dict[str, float]]:
    """One run: profile, plan, run every pipeline interleaved, print its table; returns,
    per plan, the replay figures of its trace and the plan's prediction."""
    from distributed_cases import free_port, spawn_ranks

    from autopipe.core.plan import load_plan
    from autopipe.core.profile import Profile

    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    prof_path = tmp / "profile.json"
    spawn_ranks(
        _profile_rank,
        2,
        (free_port(), args.batch_size, args.batch_size // args.microbatches, str(prof_path)),
        900,
    )
    prof = Profile.load(prof_path)
    host = json.loads(prof_path.with_suffix(".host.json").read_text())
    if args.host == "dedicated":
        host["host_throughput"] = None
    paths = _plans(prof, args.microbatches, schedules, host, tmp)
    print(
        f"profiled (rank 0 alone) and planned in {time.perf_counter() - t0:.1f} s "
        f"(profile, plans and traces in {tmp})"
    )
    print(
        f"gloo link: {host['latency_s'] * 1e6:.0f} us + bytes / "
        f"{host['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; host: "
        + (
            "ranks planned as dedicated (--host dedicated)"
            if host["host_throughput"] is None
            else f"two busy ranks run {host['host_throughput']:.2f} ranks' worth of compute"
        )
    )
    plans = {name: load_plan(path) for name, path in paths.items()}

    load_before = os.getloadavg()[0]
    spawn_ranks(_rank, 2, (free_port(), paths, args.steps, str(tmp / "out.json")), 3600)
    load_after = os.getloadavg()[0]
    result = json.loads((tmp / "out.json").read_text())
    times, busy = result["times"], result["busy"]
    replays = {}
    for name, path in result["traces"].items():
        replays[name] = {
            **_replayed(path, plans[name]),
            "predicted_s": plans[name].iteration_time_s,
            "label": _label(name, plans[name]),
        }
    replays["auto"]["torch_default_ratio"] = _torch_default_ratio(times)
    med = {k: statistics.median(v) for k, v in times.items()}

    print(
        f"examples/gpt.py ({N_LAYER} blocks), batch {args.batch_size}, K = {K} ranks x 1 thread, "
        f"gloo; n = {args.steps} steps each, interleaved"
    )
    header = (
        f"{'schedule':17s} {'V':>2s} {'M':>3s} {'chunks (units)':>18s} {'predicted':>10s} "
        f"{'measured':>10s} {'error':>7s} "
        f"{'bubble: predicted':>18s} {'measured':>9s} {'closed form':>11s}"
    )
    print(header)
    errors: dict[str, float] = {}
    for name in [*[s for s, _ in FORCED if s in schedules], "auto", TORCH_DEFAULT]:
        t = med[name]
        rank_busy = [statistics.median(b[name]) for b in busy]
        measured_bubble = 1.0 - statistics.fmean(rank_busy) / t
        if name == TORCH_DEFAULT:
            p = plans["auto"]
            v, m, sched = 1, _torch_default_m(p), "1f1b"
            chunks = f"{N_LAYER // 2} | {N_LAYER - N_LAYER // 2} blocks"
            predicted = pred_bubble = None
        else:
            p = plans[name]
            v, m, sched = p.virtual_stages, p.microbatches, p.schedule
            chunks = "/".join(str(len(s.units)) for s in p.stages)
            predicted, pred_bubble = p.iteration_time_s, p.bubble_fraction
        f, bi, bw = _chunk_fbw(p)
        closed = closed_form(sched, K, v, m, f, bi, bw)
        label = name if name != "auto" else f"auto ({p.schedule})"
        err = "" if predicted is None else f"{(t - predicted) / predicted * 100:+6.1f}%"
        if predicted is not None:
            errors[name] = abs(t - predicted) / predicted
        print(
            f"{label:17s} {v:2d} {m:3d} {chunks:>18s} "
            f"{'-' if predicted is None else f'{predicted * 1e3:7.1f} ms':>10s} "
            f"{t * 1e3:7.1f} ms {err:>7s} "
            f"{'-' if pred_bubble is None else f'{pred_bubble * 100:5.1f}%':>18s} "
            f"{measured_bubble * 100:8.1f}% "
            f"{'-' if closed is None else f'{closed * 100:5.1f}%':>11s}"
        )
    print(
        f"predicted within 15% of measured: {sum(e <= 0.15 for e in errors.values())} of "
        f"{len(errors)} (worst {max(errors.values()) * 100:.1f}%)"
    )
    print(
        f"ratio {TORCH_DEFAULT} (Schedule1F1B, even split, M = {_torch_default_m(plans['auto'])}) / "
        f"auto ({plans['auto'].schedule}, V = {plans['auto'].virtual_stages}) = "
        f"{med[TORCH_DEFAULT] / med['auto']:.2f}x (target >= 1.10x)"
    )
    print(
        f"load average (1 min) before/after: {load_before:.2f} / {load_after:.2f} "
        f"on {os.cpu_count()} CPUs"
    )
    for r in replays.values():
        print(
            f"replay {r['label']:28s} traced step {r['measured_s'] * 1e3:7.1f} ms, replayed "
            f"{r['replayed_s'] * 1e3:7.1f} ms ({_err(r['replayed_s'], r['measured_s']) * 100:+.1f}%), "
            f"chunk medians {r['replayed_medians_s'] * 1e3:7.1f} ms "
            f"({_err(r['replayed_medians_s'], r['measured_s']) * 100:+.1f}%); dispatch "
            f"{r['dispatch_s'] * 1e3:.1f} ms, tail {r['tail_s'] * 1e3:.1f} ms"
        )
    return replays


if __name__ == "__main__":
    main()
