"""The device-mesh planner's figures: Llama-2-70B on 16 H100s, a Llama-3.1-405B-like config on
512 H100s beside torchtitan's published mesh, and the planning speed for 512 GPUs.

Models are Hugging Face ``LlamaForCausalLM`` built from configs on the meta device
(benchmarks/models/hf_llama.py; nothing downloaded) and counted analytically for the catalog's
H100-SXM-80GB (8 per node, NVLink 450 GB/s per direction inside a node, 400 Gb/s InfiniBand
NDR = 50 GB/s per GPU between nodes). Mixed-precision Adam (16 bytes per parameter), bf16,
re-materialization chosen per stage (``checkpoint="auto"``; a checkpointed stage keeps its
input, or every unit's input and re-computes one unit at a time, whichever needs less), 10% of
memory kept free unless a line says otherwise.

    .venv/bin/python benchmarks/mesh_plan.py [--runs 5] [--only a|b|c]

(a) Llama-2-70B (seq 4096), 16 GPUs, batch 64: the pipeline alone (what autopipe planned
before the mesh) and the mesh search. (b) Llama-3.1-405B-like (126 layers, hidden 16384, 128
heads, 8 KV heads, FFN 53248, vocab 128256, seq 8192), 512 GPUs, global batch 256: the chosen
mesh and torchtitan's FSDP 8 x TP 8 x PP 8 (1F1B and interleaved 1F1B) priced by the same
model. (c) the whole ``autopipe plan PROFILE.json --gpus 512 --tensor-parallel auto`` command
on the 80-layer profile, imports included, median (min..max) wall time and median CPU time of
``--runs`` runs; and the whole command from the model file (profiling on meta included).
(a) and (b) are deterministic: counted analytically, the same figures on any machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from spread import MACHINE, add_runs_argument, spread

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "models"))

import hf_llama  # noqa: E402
from autopipe.planner import PlanningError, plan  # noqa: E402
from autopipe.profiler.analytic import profile_analytic  # noqa: E402

from autopipe.core.cluster import Cluster  # noqa: E402
from autopipe.core.humanize import format_bytes  # noqa: E402
from autopipe.core.plan import Plan  # noqa: E402
from autopipe.core.profile import Profile  # noqa: E402
from autopipe.core.request import PlanRequest  # noqa: E402

DEVICE = "h100"
INTER_NODE = 50e9
AUTOPIPE = Path(sys.executable).parent / "autopipe"


def count(factory: str, batch: int) -> Profile:
    """The analytic profile of ``hf_llama.FACTORY`` at ``batch`` sequences."""
    inputs_fn = getattr(hf_llama, f"example_inputs_{factory}", hf_llama.example_inputs)
    p = profile_analytic(getattr(hf_llama, factory), inputs_fn(batch), DEVICE)
    p.model = factory
    return p


def mesh(p: Plan) -> str:
    pp, dp, tp = p.mesh_shape
    return f"pp {pp} x dp {dp} x tp {tp} ({p.shard}, {p.schedule}, M={p.microbatches})"


def peak(p: Plan) -> int:
    return p.mesh.peak_bytes if p.mesh is not None else max(p.rank_peak_bytes)


def stages(p: Plan) -> None:
    """The plan's stages: units, re-materialization, bytes per device."""
    for s in p.stages:
        how = f"checkpointed per {s.checkpoint_granularity}" if s.checkpoint else "kept"
        print(f"    stage {s.index}: {s.first_module} .. {s.last_module} ({len(s.units)} units), "
              f"{how}, {format_bytes(s.memory_bytes)} (parameters {format_bytes(s.parameter_bytes)}"
              f", gradients + optimizer {format_bytes(s.optimizer_bytes)}, activations "
              f"{format_bytes(s.activation_bytes)})")  # fmt: skip


def figure_a() -> None:
    print(
        "(a) Llama-2-70B, seq 4096, 16 x H100-80GB, batch 64, mixed-precision Adam, 1F1B "
        "(deterministic)"
    )
    p = count("llama2_70b", 64)
    cluster = Cluster.from_catalog(DEVICE, 16)
    for schedule in ("gpipe", "1f1b"):
        try:
            before = plan(p, PlanRequest(cluster=cluster, checkpoint="auto", schedule=schedule))
            print(f"  pipeline only (before), {schedule}: plan, peak {format_bytes(peak(before))}")
        except PlanningError as exc:
            need = format_bytes(exc.min_memory_bytes or 0)
            print(f"  pipeline only (before), {schedule}: refused, needs {need} per device "
                  "(10% headroom incl.)")  # fmt: skip
    auto = dict(tensor_parallel="auto", data_parallel="auto", shard="auto", gpus_per_node=8,
                inter_node_bandwidth_bytes_per_s=INTER_NODE, checkpoint="auto",
                schedule="1f1b")  # fmt: skip
    for label, extra in (
        ("mesh search, 10% headroom", {}),
        ("mesh search, 2% headroom", {"headroom": 0.02}),
        ("mesh search, bf16 Adam (8 B/parameter)", {"optimizer": "adam"}),
    ):
        try:
            out = plan(p, PlanRequest(cluster=cluster, **auto, **extra))
            print(f"  {label}: {mesh(out)}, peak {format_bytes(peak(out))} per device, "
                  f"step {out.iteration_time_s:.3g} s")  # fmt: skip
            if not extra:
                stages(out)
        except PlanningError as exc:
            need = exc.min_memory_bytes or 0
            raw = need / (1 + float(extra.get("headroom", 0.1)))
            print(f"  {label}: refused, smallest need {format_bytes(need)} per device "
                  f"(headroom incl.; {format_bytes(raw)} without)")  # fmt: skip


def figure_b() -> None:
    print("(b) Llama-3.1-405B-like, seq 8192, 512 x H100-80GB, global batch 256 (deterministic)")
    p = count("llama31_405b", 256)
    cluster = Cluster.from_catalog(DEVICE, 512)
    common = dict(cluster=cluster, batch_size=256, gpus_per_node=8,
                  inter_node_bandwidth_bytes_per_s=INTER_NODE, checkpoint="auto")  # fmt: skip
    tokens = 256 * 8192
    rows: list[tuple[str, Plan | None, str]] = []
    for schedule in ("1f1b", "interleaved-1f1b"):
        started, cpu = time.perf_counter(), time.process_time()
        chosen = plan(
            p,
            PlanRequest(
                tensor_parallel="auto",
                data_parallel="auto",
                shard="auto",
                schedule=schedule,
                **common,
            ),
        )
        took = f"{time.perf_counter() - started:.0f} s wall / {time.process_time() - cpu:.0f} s CPU"
        rows.append((f"autopipe search, {schedule}", chosen, took))
    for schedule in ("1f1b", "interleaved-1f1b"):
        try:
            out = plan(
                p,
                PlanRequest(
                    tensor_parallel=8,
                    data_parallel=8,
                    shard="parameters",
                    schedule=schedule,
                    # torchtitan keeps the logits sharded over TP (loss parallel, its default)
                    loss_parallel=True,
                    **common,
                ),
            )
            rows.append((f"torchtitan FSDP 8 x TP 8 x PP 8, {schedule}", out, ""))
        except PlanningError as exc:
            rows.append((f"torchtitan FSDP 8 x TP 8 x PP 8, {schedule}", None, str(exc)))
    for label, out, note in rows:
        if out is None:
            print(f"  {label}: refused: {note}")
            continue
        print(f"  {label}: {mesh(out)}, peak {format_bytes(peak(out))} per device, step "
              f"{out.iteration_time_s:.3g} s, {tokens / out.iteration_time_s / 512:.0f} tokens/s "
              f"per GPU{'; searched in ' + note if note else ''}")  # fmt: skip


def run(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _import_planner(_: int) -> None:
    import autopipe.planner.mesh  # noqa: F401


def figure_c(repeats: int) -> None:
    print(f"(c) planning speed: 80-layer Llama-2-70B config on 512 x H100, batch 256, "
          f"{repeats} runs ({MACHINE}): wall median (min..max) / CPU median")  # fmt: skip
    model = f"{ROOT / 'benchmarks' / 'models' / 'hf_llama.py'}:llama2_70b"
    mesh_flags = ["--gpus", "512", "--tensor-parallel", "auto", "--schedule", "1f1b", "-q"]
    with tempfile.TemporaryDirectory() as tmp:
        saved = str(Path(tmp) / "profile.json")
        subprocess.run(
            [str(AUTOPIPE), "profile", model, "--device", DEVICE, "--batch-size", "256", "-q",
             "--json", saved],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        cases = {
            "from the saved profile": [str(AUTOPIPE), "plan", saved, *mesh_flags],
            "from the model file (profiling on meta included)": [
                str(AUTOPIPE), "plan", model, "--device", DEVICE, "--batch-size", "256",
                *mesh_flags,
            ],
        }  # fmt: skip
        search_s = []
        profile = Profile.load(saved)
        for _ in range(repeats):
            started = time.perf_counter()
            plan(
                profile,
                PlanRequest(
                    cluster=Cluster.from_catalog(DEVICE, 512),
                    batch_size=256,
                    tensor_parallel="auto",
                    data_parallel="auto",
                    shard="auto",
                    gpus_per_node=8,
                    inter_node_bandwidth_bytes_per_s=INTER_NODE,
                    checkpoint="auto",
                    schedule="1f1b",
                ),
            )
            search_s.append(time.perf_counter() - started)
        pool_s = []
        for _ in range(repeats):
            started = time.perf_counter()
            with ProcessPoolExecutor(2) as pool:
                list(pool.map(_import_planner, range(2)))
            pool_s.append(time.perf_counter() - started)
        print(f"  the mesh search in-process: {spread(search_s, unit=' s')}; starting a "
              f"2-process pool that imports the planner: {statistics.median(pool_s):.2f} s "
              "(so the meshes are searched one after another)")  # fmt: skip
        for label, command in cases.items():
            runs = [run(command) for _ in range(repeats)]
            walls = [w for w, _ in runs]
            cpu = statistics.median(c for _, c in runs)
            verdict = "pass" if statistics.median(walls) < 10 else "FAIL"
            print(f"  {label}: {spread(walls, '{:.1f}', ' s')} / {cpu:.1f} s "
                  f"(target < 10 s wall: {verdict})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_runs_argument(parser)
    parser.add_argument("--only", choices=["a", "b", "c"])
    args = parser.parse_args()
    for name, figure in (("a", figure_a), ("b", figure_b)):
        if args.only in (None, name):
            figure()
    if args.only in (None, "c"):
        figure_c(args.runs)


if __name__ == "__main__":
    main()
