"""The replay of the 4-rank mesh runs: planned by ``autopipe plan``, trained by ``torchrun ...
autopipe run --trace`` on 4 gloo processes, replayed by ``autopipe replay``.

PP 2 x TP 2 is tests/test_distributed_mesh.py's; here the other meshes ``autopipe run``
runs: PP 2 x FSDP2 2, TP 2 x FSDP2 2 (one pipeline stage) and PP 2 x D 2 with ZeRO-1. The
trace holds replica 0's pipeline ranks (one per stage: the TP and data-parallel peers of a
stage run the same actions in step, their collectives inside those actions), and every
step replays exactly from its own durations: the same tolerance as the PP 2 x TP 2 test.
``pytest -s`` prints each step's figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_cases import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "hf_llama.py")
STEPS = 3

MESHES: dict[str, tuple[list[str], tuple[int, int, int]]] = {
    "pp2fsdp2": (["--tensor-parallel", "1", "--data-parallel", "2", "--shard", "parameters"],
                 (2, 2, 1)),
    "tp2fsdp2": (["--tensor-parallel", "2", "--data-parallel", "2", "--shard", "parameters"],
                 (1, 2, 2)),
    "pp2d2zero1": (["--tensor-parallel", "1", "--data-parallel", "2", "--shard", "optimizer"],
                   (2, 2, 1)),
}  # fmt: skip
"""Per mesh: the ``autopipe plan --gpus 4`` flags that force it, and its (pp, dp, tp)."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profile cache for the three plans (the model is profiled once)."""
    return tmp_path_factory.mktemp("mesh-replay-cache")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_mesh_run_replays_exactly(mesh: str, tmp_path: Path, cache: Path) -> None:
    flags, shape = MESHES[mesh]
    plan_path, trace, out = tmp_path / "plan.json", tmp_path / "trace.json", tmp_path / "r.json"
    env = {**os.environ, "PYTHONHASHSEED": "0", "AUTOPIPE_CACHE_DIR": str(cache)}
    planned = subprocess.run(
        [sys.executable, "-m", "autopipe", "plan", MODEL, "--gpus", "4", *flags,
         "--allreduce-bandwidth", "10GB/s", "--json", str(plan_path), "-q"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(plan_path.read_text())
    pp, dp, tp = shape
    assert (plan["num_stages"], plan["data_parallel"], plan["tensor_parallel"]) == (pp, dp, tp)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-port", str(free_port()), "-m", "autopipe", "run", MODEL,
         "--plan", str(plan_path), "--steps", str(STEPS), "--timeout", "120",
         "--trace", str(trace)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"{pp} stages x {dp} replicas" in run.stdout + run.stderr
    replayed = subprocess.run(
        [sys.executable, "-m", "autopipe", "replay", str(trace), "--plan", str(plan_path),
         "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    print(f"\n{mesh} (pp {pp} x dp {dp} x tp {tp}, {plan['schedule']}, "
          f"M = {plan['microbatches']}):\n{replayed.stdout}")  # fmt: skip
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert len(s["ranks"]) == pp  # replica 0's pipeline: one rank per stage
        assert s["order_differs"] == [] and abs(s["error"]) < 1e-6, s
