"""`autopipe run` from the command line: torchrun launch, help, launch outside torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_cases import free_port, set_order_files, tiny_gpt_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    return tiny_gpt_files(tmp_path, "1f1b")


def test_torchrun_trains_and_reports_loss_and_step_time(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    model, plan = files
    log = tmp_path / "steps.json"
    # The documented command: torchrun --nproc-per-node 2 $(which autopipe) run ...
    script = shutil.which("autopipe", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the autopipe console script is not installed next to this interpreter")
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()),
            script, "run", str(model), "--plan", str(plan),
            "--steps", "4", "--lr", "3e-3", "--timeout", "60", "--json", str(log),
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 stages x 1 replicas on 2 processes (gloo), schedule 1f1b" in out.stdout
    assert "step 4/4  loss" in out.stdout and "median step time" in out.stdout
    steps = json.loads(log.read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert steps[-1]["loss"] < steps[0]["loss"]  # it trains
    assert all(s["time_s"] > 0 for s in steps)


def _torchrun(model: Path, plan: Path, log: Path, *extra: str) -> list[float]:
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()),
            "-m", "autopipe", "run", str(model), "--plan", str(plan),
            "--steps", "3", "--timeout", "60", "--json", str(log), "-q", *extra,
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return [s["loss"] for s in json.loads(log.read_text())["steps"]]


@pytest.mark.slow
def test_meta_build_with_state_dict_trains_like_the_replicated_model(
    files: tuple[Path, Path], tmp_path: Path
) -> None:
    import torch

    from autopipe.modelfile import load_model_file

    model, plan = files
    weights = tmp_path / "weights.pt"
    torch.save(load_model_file(str(model)).build().state_dict(), weights)
    replicated = _torchrun(model, plan, tmp_path / "a.json")
    from_file = _torchrun(model, plan, tmp_path / "b.json", "--state-dict", str(weights))
    assert from_file == pytest.approx(replicated, rel=1e-6, abs=1e-6)


def test_run_outside_torchrun_says_how_to_launch(files: tuple[Path, Path]) -> None:
    model, plan = files
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [sys.executable, "-m", "autopipe", "run", str(model), "--plan", str(plan)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 2
    assert "start this under torchrun" in out.stderr


def test_run_help_shows_torchrun_examples() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "autopipe", "run", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0
    assert "torchrun --nproc-per-node 2" in out.stdout and "--rdzv-endpoint" in out.stdout


def test_a_model_file_class_has_one_name_in_every_process() -> None:
    """Ranks compare the class of the model they built; a class defined in the model file
    itself must get the same qualified name in every process (str hashes are salted per
    process, so a hash-named module made examples/gpt.py 'different models' on two ranks)."""
    code = (
        "from autopipe.modelfile import load_model_file; "
        "print(type(load_model_file('examples/gpt.py').build()).__module__)"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, cwd=ROOT, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(names) == 1, names


def test_torchrun_runs_two_chunks_per_rank_and_trains_as_one_stage_per_rank(
    tmp_path: Path,
) -> None:
    """`autopipe run` with a ZBV plan (V = 2 chunks per rank in a V: rank 0 computes the
    loss) trains exactly as the 2-stage GPipe plan of the same model."""
    model, plan = tiny_gpt_files(tmp_path, "zbv", virtual_stages=2)
    zbv = _torchrun(model, plan, tmp_path / "zbv.json")
    model, plan = tiny_gpt_files(tmp_path, "gpipe")
    gpipe = _torchrun(model, plan, tmp_path / "gpipe.json")
    assert len(zbv) == 3 and zbv == pytest.approx(gpipe, rel=1e-5, abs=1e-6)


def test_python_m_autopipe_run_without_a_hash_seed_trains_like_one_process(
    tmp_path: Path,
) -> None:
    """A model whose forward iterates a set of strings, under torchrun with PYTHONHASHSEED
    unset: every rank would hash with its own seed and trace another graph (before: the
    products crossing the cut arrived in other places, and the losses were not one
    process's). `python -m autopipe run` re-executes itself with one seed, so the ranks
    trace one graph and train exactly as one process (AdamW at the default --lr)."""
    import torch

    from autopipe.modelfile import load_model_file

    model_file, plan = set_order_files(tmp_path)
    log = tmp_path / "steps.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()),
            "-m", "autopipe", "run", str(model_file), "--plan", str(plan),
            "--steps", "3", "--timeout", "60", "--json", str(log), "-q",
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [s["loss"] for s in json.loads(log.read_text())["steps"]]

    mf = load_model_file(str(model_file))
    model, inputs = mf.build(), mf.inputs(8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    expected = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = mf.loss_fn(model(inputs), inputs)
        loss.backward()
        optimizer.step()
        expected.append(float(loss.detach()))
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-7)
