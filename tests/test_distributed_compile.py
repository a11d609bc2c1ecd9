"""``autopipe run`` on a plan made with ``--compile`` (``Plan.trainer.compile``): every stage
runs ``torch.compile``'d (runtime/distributed/stages.py ``StageModule.compile_body``), also
one re-materialized per unit, and trains as the eager stages do."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_cases import TINY_GPT_UNITS, free_port, make_plan, tiny_gpt_files

from autopipe.core.plan import load_plan
from autopipe.core.trainer_options import TrainerOptions

ROOT = Path(__file__).resolve().parents[1]


def _run(model: Path, plan: Path, log: Path, inductor_cache: Path) -> tuple[str, list[float]]:
    """Three steps on 2 gloo ranks: what rank 0 prints and the losses."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_cache))
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()),
            "-m", "autopipe", "run", str(model), "--plan", str(plan),
            "--steps", "3", "--timeout", "100", "--json", str(log),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=240, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, [s["loss"] for s in json.loads(log.read_text())["steps"]]


def _trains_compiled_as_eager(
    model: Path, eager_plan: Path, compiled_plan: Path, tmp: Path
) -> None:
    """Both plans run 3 steps on 2 gloo ranks: the compiled one says so and builds inductor's
    kernels, the eager one neither, and their losses agree (and fall)."""
    eager_cache, compiled_cache = tmp / "eager-inductor", tmp / "compiled-inductor"
    eager_out, eager = _run(model, eager_plan, tmp / "eager-steps.json", eager_cache)
    out, compiled = _run(model, compiled_plan, tmp / "compiled-steps.json", compiled_cache)
    assert "stages torch.compile'd" in out and "torch.compile'd" not in eager_out
    # inductor built its kernels (it compiled); nothing for the eager run.
    assert len(list(compiled_cache.rglob("*.so"))) > 0
    assert list(eager_cache.rglob("*")) == []
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert compiled[-1] < compiled[0]  # it trains


def test_a_compiled_plan_runs_compiled_stages_and_trains_as_eager(tmp_path: Path) -> None:
    model, eager_plan = tiny_gpt_files(tmp_path, "1f1b")
    plan = load_plan(eager_plan)
    plan.trainer = TrainerOptions(compile=True)  # what the ranks act on (#34)
    # Stage 0 re-materialized per unit: its units' functions are compiled one by one.
    plan.stages[0] = dataclasses.replace(
        plan.stages[0], checkpoint=True, checkpoint_granularity="unit"
    )
    compiled_plan = tmp_path / "compiled-plan.json"
    plan.save(compiled_plan)

    _trains_compiled_as_eager(model, eager_plan, compiled_plan, tmp_path)


def test_a_compiled_fsdp_plan_compiles_after_sharding_and_trains_as_eager(tmp_path: Path) -> None:
    """One stage on FSDP2 over 2 gloo ranks (shard ``parameters``): the ranks shard, then
    compile (torchtitan's order), and the losses equal the eager run's."""
    model, _ = tiny_gpt_files(tmp_path, "1f1b")
    plan = dataclasses.replace(
        make_plan([TINY_GPT_UNITS], 2, 4), data_parallel=2, shard="parameters"
    )
    eager_plan, compiled_plan = tmp_path / "fsdp-plan.json", tmp_path / "fsdp-compiled-plan.json"
    plan.save(eager_plan)
    plan.trainer = TrainerOptions(compile=True)
    plan.save(compiled_plan)

    _trains_compiled_as_eager(model, eager_plan, compiled_plan, tmp_path)
