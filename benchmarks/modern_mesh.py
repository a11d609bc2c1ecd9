"""The whole modern mesh (issue 35): the mesh autopipe chooses over PP x D x C x T x shard
with expert parallelism E, beside the published one, both priced by the same model.

(a) DeepSeek-V3 (671 B parameters, 61 layers, 256 routed experts + 1 shared, top-8, MLA;
benchmarks/models/modern.py) on 2048 H800s (8 per node, NVLink 200 GB/s per direction,
400 Gb/s InfiniBand per GPU), global batch 15360 sequences of 4096 tokens (its final batch):
the search vs the published PP16 x EP64 with ZeRO-1 data parallelism (DP 128, TP 1).
(b) Llama 3 405B at 128K tokens on 16384 H100s (8 per node), global batch 128 sequences (16M
tokens): the search vs the published TP8 x CP16 x PP16 x DP8.

Both models are counted analytically on the meta device (profiling is not timed), planned with
1F1B (the schedule both meshes are priced with), mixed-precision Adam, re-materialization where
memory needs it, the default expert load imbalance 1.25. Printed: each mesh, its step and
tokens/s per GPU, peak memory per device, and the search's wall time and number of meshes
weighed and searched (target: under 30 s each, of the process's CPU time: the wall time of a
shared host counts other jobs), with the work counted, which the host's load does not
change: pipeline searches (one per mesh, or per M with ``parameters`` sharding) and
min-bottleneck probes (``planner/probe.py``; the pruning test's and the exact partitions').
A progress bar (stderr) counts the meshes searched so far.

    .venv/bin/python benchmarks/modern_mesh.py [--only a|b] [--profiles DIR] [--gpus N]
        [--repeat R]

``--profiles DIR`` keeps the counted profiles as JSON there and reuses them on the next run;
``--gpus N`` plans the case on N devices instead of the published count (a smaller variant,
e.g. to time an older checkout beside this one); ``--repeat R`` plans each case R times and
prints the median CPU time (the counts are the same each time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "models"))

from autopipe.planner import PlanningError, plan  # noqa: E402

from autopipe.core.catalog import get_device  # noqa: E402
from autopipe.core.cluster import Cluster  # noqa: E402
from autopipe.core.humanize import format_bytes  # noqa: E402
from autopipe.core.plan import Plan  # noqa: E402
from autopipe.core.profile import Profile  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

TARGET_S = 30.0
CASES = {
    "a": dict(
        title="DeepSeek-V3 (671B MoE) on 2048 x H800, batch 15360 x 4096 tokens",
        factory="deepseek_v3", profile_batch=8, device="h800", gpus=2048, batch=15360,
        seq=4096, published=dict(tensor_parallel=1, data_parallel=128, context_parallel=1,
                                 expert_parallel=64, shard="optimizer"),
        published_name="published PP16 x EP64, ZeRO-1 DP128",
    ),
    "b": dict(
        title="Llama 3 405B at 128K tokens on 16384 x H100, batch 128 x 131072 tokens",
        factory="llama3_405b_128k", profile_batch=1, device="h100", gpus=16384, batch=128,
        seq=131072, published=dict(tensor_parallel=8, data_parallel=8, context_parallel=16,
                                   expert_parallel=1, shard="auto"),
        published_name="published TP8 x CP16 x PP16 x DP8",
    ),
}  # fmt: skip


def counted(factory: str, batch: int, device: str, keep: Path | None) -> Profile:
    """The analytic profile of ``modern.FACTORY`` at ``batch`` sequences (kept in ``keep``)."""
    path = keep / f"{factory}_{device}_{batch}.json" if keep is not None else None
    if path is not None and path.exists():
        return Profile.load(path)
    import modern
    from autopipe.profiler.analytic import profile_analytic
    from autopipe.profiler.options import AnalyticOptions

    inputs = getattr(modern, f"example_inputs_{factory}")(batch)
    p = profile_analytic(
        getattr(modern, factory), inputs, device, AnalyticOptions(dtype="bfloat16")
    )
    p.model = factory
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        p.save(path)
    return p


def request(case: dict, **mesh: object) -> PlanRequest:
    return PlanRequest(
        cluster=Cluster.from_catalog(case["device"], case["gpus"]),
        batch_size=case["batch"], gpus_per_node=8, checkpoint="auto", schedule="1f1b",
        inter_node_bandwidth_bytes_per_s=get_device(case["device"]).inter_node_bandwidth_bytes_per_s,
        **mesh,  # type: ignore[arg-type]
    )  # fmt: skip


def describe(p: Plan) -> str:
    pp, dp, tp = p.mesh_shape
    return (
        f"PP{pp} x DP{dp} x TP{tp} x CP{p.context_parallel}, EP{p.expert_parallel}, "
        f"shard {p.shard}, M={p.microbatches}"
    )


def line(label: str, p: Plan, case: dict) -> str:
    peak = p.mesh.peak_bytes if p.mesh is not None else max(p.rank_peak_bytes)
    tokens = case["batch"] * case["seq"] / p.iteration_time_s / case["gpus"]
    return (
        f"  {label}: {describe(p)}\n      step {p.iteration_time_s:.4g} s, {tokens:.0f} tokens/s "
        f"per GPU, peak {format_bytes(peak)} per device"
    )


@contextmanager
def searches_shown(label: str, work: dict[str, int]) -> Iterator[None]:
    """A tqdm bar on stderr counting the meshes whose pipeline the search runs (the planner
    is torch-free and prints nothing; its one-mesh search is wrapped for the count), and in
    ``work`` the pipeline searches and probes it makes (wrapped the same way)."""
    import autopipe.planner.mesh as mesh
    import autopipe.planner.probe as probe
    from tqdm import tqdm

    real: Callable[..., Any] = mesh._search
    real_pipeline: Callable[..., Any] = mesh.plan_pipeline
    real_probe: Callable[..., Any] = probe._Prober.probe
    bar = tqdm(desc=f"{label}: meshes searched", unit=" mesh", file=sys.stderr, leave=False)

    def counted_search(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        bar.update(1)
        return out

    def counted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            work[name] = work.get(name, 0) + 1
            return call(*args, **kwargs)

        return wrapped

    mesh._search = counted_search  # type: ignore[assignment]
    mesh.plan_pipeline = counted("pipeline searches", real_pipeline)  # type: ignore[assignment]
    probe._Prober.probe = counted("probes", real_probe)  # type: ignore[method-assign]
    try:
        yield
    finally:
        mesh._search = real  # type: ignore[assignment]
        mesh.plan_pipeline = real_pipeline  # type: ignore[assignment]
        probe._Prober.probe = real_probe  # type: ignore[method-assign]
        bar.close()


def run_case(name: str, keep: Path | None, gpus: int | None = None, repeat: int = 1) -> None:
    case = dict(CASES[name], gpus=gpus) if gpus else CASES[name]
    title = case["title"] if not gpus else f"{case['title']} (on {gpus} devices)"
    print(f"({name}) {title}")
    p = counted(case["factory"], case["profile_batch"], case["device"], keep)
    walls, cpus = [], []
    for _ in range(max(repeat, 1)):
        work: dict[str, int] = {}
        started, cpu = time.perf_counter(), time.process_time()
        with searches_shown(f"({name})", work):
            chosen = plan(
                p,
                request(
                    case, tensor_parallel="auto", data_parallel="auto", shard="auto",
                    context_parallel="auto", expert_parallel="auto",
                ),
            )  # fmt: skip
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
    took, took_cpu = statistics.median(walls), statistics.median(cpus)
    assert chosen.mesh is not None
    rows = chosen.mesh.candidates
    searched = sum(r.searched for r in rows)
    verdict = "pass" if took_cpu <= TARGET_S else "FAIL"
    each = (
        f", median of {len(cpus)}: {', '.join(f'{c:.1f}' for c in cpus)}" if len(cpus) > 1 else ""
    )
    print(line("autopipe's choice", chosen, case))
    print(
        f"      searched {searched} of {len(rows)} meshes in {took_cpu:.1f} s of CPU "
        f"({took:.1f} s wall on a shared host{each}; target {TARGET_S:.0f} s: {verdict})"
    )
    print(f"      work: {work.get('pipeline searches', 0)} pipeline searches, "
          f"{work.get('probes', 0)} probes")  # fmt: skip
    try:
        published = plan(p, request(case, **case["published"]))
        print(line(case["published_name"], published, case))
        print(f"      autopipe's step / published step: "
              f"{chosen.iteration_time_s / published.iteration_time_s:.3f}")  # fmt: skip
    except PlanningError as exc:
        print(f"  {case['published_name']}: refused by the model: {str(exc).splitlines()[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES))
    parser.add_argument("--profiles", type=Path, help="keep / reuse the counted profiles here")
    parser.add_argument("--gpus", type=int, help="plan on this many devices instead")
    parser.add_argument("--repeat", type=int, default=1, help="plan each case this many times")
    args = parser.parse_args()
    for name in [args.only] if args.only else sorted(CASES):
        run_case(name, args.profiles, args.gpus, args.repeat)


if __name__ == "__main__":
    main()
